"""Checkpoint formats behind one interface (base.py), and the one load (loader.py).

- base.py: Checkpoint (a path opened once), CheckpointFormat (detect, a LinearMethod per
  layer, attach / load / finish) and LinearMethod (create_weights, process after loading);
- loader.py: open → detect → build → attach → load → finish, for every format;
- unquantised.py: float safetensors; quantise.py: int8 / int4 at load;
  compressed_tensors.py: pack-quantized W4A16 / W8A16; gptq.py: GPTQ and AWQ;
  gguf/: llama.cpp's files (unpacking, names, hybrid transforms, experts, tokenizer);
- streaming.py, tensor_map.py: safetensors streaming and checkpoint names → parameters;
  methods.py: the packed products every quantised format installs.

Nothing is imported here, so the torch-free parts (gguf/tokenizer.py, which the daemon
uses) stay torch-free.
"""
