"""An image's pixels as the tower's input: normalised, cut into patches (torch).

The layout is transformers' Qwen2-VL patchify, so the tower sees what it was trained
on: [grid_h × grid_w, channels × temporal_patch_size × patch_size²], the patches of
each merge_size × merge_size block consecutive (the merger joins them into one token),
blocks in raster order, every patch repeated temporal_patch_size times.

Values are bit-exact with transformers' PIL backend: rescaling is float64 then cast
to float32, normalising float32, as numpy does there; here both are one table of the
256 values per channel, looked up.
"""

from __future__ import annotations

import torch

from helexa.neuron.vision.processor import ImageProcessor, PreparedImage


def value_table(proc: ImageProcessor, device: torch.device | str = "cpu") -> torch.Tensor:
    """[3, 256] float32: what each 8-bit value of each channel becomes."""
    v = torch.arange(256, dtype=torch.float64)
    x = (v * proc.rescale_factor if proc.do_rescale else v).float()
    x = x.unsqueeze(0).expand(3, 256)
    if proc.do_normalize:
        mean = torch.tensor(proc.image_mean, dtype=torch.float32)[:, None]
        std = torch.tensor(proc.image_std, dtype=torch.float32)[:, None]
        x = (x - mean) / std
    return x.contiguous().to(device)


def pixel_patches(image: PreparedImage, proc: ImageProcessor, table: torch.Tensor
                  ) -> torch.Tensor:
    """float32 [grid_h × grid_w, 3 × T × P × P] on table's device."""
    p, m, t = proc.patch_size, proc.merge_size, proc.temporal_patch_size
    gh, gw = image.grid_h, image.grid_w
    raw = torch.frombuffer(bytearray(image.pixels), dtype=torch.uint8)
    hwc = raw.to(table.device).view(gh * p, gw * p, 3).long()
    hwc += torch.tensor([0, 256, 512], device=table.device)  # each channel its own row
    chw = table.view(-1)[hwc].permute(2, 0, 1)  # [3, H, W], one gather
    x = chw.view(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    x = x.unsqueeze(5).expand(*x.shape[:5], t, p, p)  # [gh/m, gw/m, m, m, 3, T, P, P]
    return x.reshape(gh * gw, 3 * t * p * p)
