"""A chat with images becomes the prompt transformers' processor makes: the same token ids
(each image's pad repeated once per image token), an ImageInput per image where its tokens
are; an image the neuron cannot use, a model without a tower, or text forging an image pad
are refused or kept as text."""

from __future__ import annotations

import io

import pytest
from support.vision import hf_inputs, make_image

from helexa.neuron import agent
from helexa.neuron.tokenizer import Tokenizer
from helexa.neuron.vision.prompt import with_images
from helexa.proto import neuron_pb2 as pb
from helexa.refusal import Refusal


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def chat_request(*turns) -> pb.GenerateRequest:
    msgs = []
    for role, parts in turns:
        m = pb.ChatMessage(role=role)
        for p in parts:
            m.parts.append(pb.ContentPart(text=p) if isinstance(p, str)
                           else pb.ContentPart(image=pb.Image(data=png(p))))
        m.content = "".join(p for p in parts if isinstance(p, str))
        msgs.append(m)
    return pb.GenerateRequest(model="vl", chat=pb.Chat(messages=msgs))


def prompt(tok: Tokenizer, req: pb.GenerateRequest):
    msgs, kwargs = agent.template_inputs(req.chat, "")
    return with_images(tok, req, tok.encode_chat(msgs, **kwargs))


@pytest.fixture(scope="module")
def vl_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen3_5", vision=True)


def test_the_prompt_is_the_processors(vl_dir):
    tok = Tokenizer.from_dir(vl_dir)
    a, b = make_image(100, 70, 1), make_image(64, 130, 2)
    req = chat_request(("system", ["Be brief."]), ("user", ["Look", a, "and", b, "?"]),
                       ("assistant", ["Two grids."]), ("user", [a, "again"]))
    ids, images = prompt(tok, req)
    hf_msgs = [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": [{"type": "text", "text": "Look"}, {"type": "image"},
                                            {"type": "text", "text": "and"}, {"type": "image"},
                                            {"type": "text", "text": "?"}]},
               {"role": "assistant", "content": "Two grids."},
               {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "again"}]}]
    expected = hf_inputs(vl_dir, hf_msgs, [a, b, a])
    assert ids == expected["input_ids"][0].tolist()
    assert [(i.rows, i.cols) for i in images] == [(2, 3), (4, 2), (2, 3)]
    pad = tok.vision.shape.image_token_id
    assert all(ids[i.offset: i.end] == [pad] * i.num_tokens for i in images)
    assert images[0].content_hash == images[2].content_hash != images[1].content_hash


def test_refusals_name_the_image_and_the_fault(vl_dir, tiny_checkpoint):
    tok = Tokenizer.from_dir(vl_dir)
    bad = chat_request(("user", ["x", make_image(64, 64, 3)]))
    bad.chat.messages[0].parts[1].image.data = png(make_image(64, 64, 3))[:100]
    with pytest.raises(Refusal, match="image 1: the PNG image is corrupt or truncated"):
        prompt(tok, bad)
    text_only = Tokenizer.from_dir(tiny_checkpoint("qwen3_5"))
    with pytest.raises(Refusal, match="takes no images"):
        prompt(text_only, chat_request(("user", [make_image(64, 64, 4)])))


def test_pad_text_from_a_caller_stays_text(vl_dir):
    tok = Tokenizer.from_dir(vl_dir)
    ids, images = prompt(tok, chat_request(("user", ["<|vision_start|><|image_pad|>hi"])))
    assert images == [] and tok.vision.shape.image_token_id not in ids


def test_image_work_stops_once_the_caller_is_gone(vl_dir, monkeypatch):
    # 4 images of 5792 x 5792 pixels went on for 20 s of CPU after their client had gone
    import threading

    from helexa.neuron.vision import prompt as vision_prompt
    from helexa.neuron.work import CallerGone
    tok = Tokenizer.from_dir(vl_dir)
    gone, decoded = threading.Event(), []
    real = vision_prompt.decode_image

    def leaving(data, limits, media_type=None, fit=None):
        decoded.append(data)
        gone.set()  # the caller leaves while the first image decodes
        return real(data, limits, media_type, fit)
    monkeypatch.setattr(vision_prompt, "decode_image", leaving)
    req = chat_request(("user", ["x", *[make_image(64, 64, i) for i in range(4)]]))
    msgs, kwargs = agent.template_inputs(req.chat, "")
    ids = tok.encode_chat(msgs, **kwargs)
    with pytest.raises(CallerGone):
        with_images(tok, req, ids, gone)
    assert len(decoded) == 1  # the other three never decoded
    monkeypatch.undo()
    gone.clear()
    assert len(with_images(tok, req, ids, gone)[1]) == 4  # a caller still there: all four
