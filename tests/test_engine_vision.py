"""Issue 45, the engine: the CPU engine takes SGLang 0.5.23's image request (``input_ids`` with one wrapped
``<|image_pad|>`` per image + ``image_data``) and answers as HF's Qwen2.5-VL does, with and without prefix reuse.

Reference: HF's ``Qwen2_5_VLForConditionalGeneration`` on the same checkpoint (the tiny VLM, built locally), fed
its own image processor's pixels and the engine's expanded ids, generating greedily; its positions come from HF's
``get_rope_index``.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from slime_server.rollout.cpu_engine import BadRequest, CPUEngine
from slime_server.rollout.engine_config import EngineConfig
from slime_server.rollout.engine_vision import MAX_IMAGE_PIXELS, rope_index
from slime_server.rollout.protocol import SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
SIZES = [(56, 56), (100, 60), (150, 120)]  # (width, height): 4, 8 and 20 image tokens


@pytest.fixture(scope="module")
def tok(vl_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vl_path)


@pytest.fixture(scope="module")
def hf(vl_path: Path) -> Any:
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.set_num_threads(1)
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(vl_path).eval()


@pytest.fixture(scope="module")
def engine(vl_path: Path) -> Any:
    eng = CPUEngine(EngineConfig(model_path=str(vl_path), num_threads=1))
    yield eng
    eng.shutdown()


def picture(size: tuple[int, int], seed: int, fmt: str = "PNG") -> tuple[Any, str]:
    """A noise image and its data URL (noise: every patch differs, so the model cannot ignore where it looks)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    img = Image.fromarray((torch.rand(size[1], size[0], 3, generator=g) * 255).to(torch.uint8).numpy())
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return img, f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


def chat_ids(tok: Any, turns: list[list[str]], answers: list[str] = ()) -> list[int]:
    """A conversation's prompt ids: user turn i holds an image before each of its texts."""
    messages: list[dict[str, Any]] = []
    for i, texts in enumerate(turns):
        content: list[dict[str, str]] = []
        for t in texts:
            content += [{"type": "image"}, {"type": "text", "text": t}]
        messages.append({"role": "user", "content": content})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def hf_greedy(hf: Any, vl_path: Path, ids: list[int], images: list[Any], n: int) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and their log-probs for the expanded ``ids`` with ``images``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    enc = Qwen2VLImageProcessorPil.from_pretrained(vl_path)(images=images, return_tensors="pt")
    x = torch.tensor([ids])
    out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), pixel_values=enc["pixel_values"],
                      image_grid_thw=enc["image_grid_thw"], mm_token_type_ids=(x == hf.config.image_token_id).long(),
                      max_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True,
                      eos_token_id=None)
    got = out.sequences[0, len(ids):].tolist()
    return got, [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, got, strict=True)]


def image_tokens(vl_path: Path, width: int, height: int) -> int:
    """HF's count: the image resized to multiples of 28 within the processor's pixel bounds, one token per 28 x 28."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    cfg = json.loads((vl_path / "preprocessor_config.json").read_text())
    h, w = smart_resize(height, width, factor=28, min_pixels=cfg["min_pixels"], max_pixels=cfg["max_pixels"])
    return h * w // 28 ** 2


def run(engine: CPUEngine, ids: list[int], urls: list[str]) -> Any:
    expanded, mm = engine.prepare_images(ids, urls)
    return expanded, mm, engine.generate(expanded, GREEDY, return_logprob=True, images=mm)[0]


def lps(out: Any) -> list[float]:
    return [e[0] for e in out.meta_info.output_token_logprobs]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_engine_answers_as_hf_with_images_of_different_sizes(engine, hf, tok, vl_path, k: int) -> None:
    pics = [picture(s, seed=i) for i, s in enumerate(SIZES[:k])]
    ids = chat_ids(tok, [[f"picture {i}" for i in range(k)]])
    expanded, mm, out = run(engine, ids, [u for _, u in pics])
    # one pad per image became grid / merge**2 pads; every other id is the caller's
    merge = hf.config.vision_config.spatial_merge_size
    assert [im.tokens for im in mm.images] == [image_tokens(vl_path, w, h) for w, h in SIZES[:k]]
    assert len(expanded) == len(ids) - k + mm.image_tokens
    assert [t for t in expanded if t != hf.config.image_token_id] == [t for t in ids if t != hf.config.image_token_id]
    # mRoPE positions and delta: HF's get_rope_index
    x = torch.tensor([expanded])
    grids = torch.tensor([im.grid for im in mm.images])
    pos, delta = hf.model.get_rope_index(x, (x == hf.config.image_token_id).long(), image_grid_thw=grids)
    assert torch.equal(mm.positions, pos[:, 0]) and mm.delta == int(delta)
    assert torch.equal(rope_index(len(expanded), [(im.offset, im.grid) for im in mm.images], merge)[0], mm.positions)
    want_ids, want_lp = hf_greedy(hf, vl_path, expanded, [p for p, _ in pics], GREEDY.max_new_tokens)
    assert out.output_ids == want_ids
    assert lps(out) == pytest.approx(want_lp, abs=1e-4)
    assert out.meta_info.prompt_tokens == len(expanded) and out.meta_info.image_tokens == mm.image_tokens
    # the images are seen: another first image changes the answer's log-probs
    other = run(engine, ids, [picture(SIZES[0], seed=99)[1]] + [u for _, u in pics[1:]])[2]
    assert max(abs(a - b) for a, b in zip(lps(other), lps(out), strict=False)) > 1e-3


def test_next_turn_reuses_the_prefix_through_its_images_only_when_they_are_the_same(engine, hf, tok, vl_path) -> None:
    first_pics = [picture(SIZES[1], seed=5)]
    turn1 = chat_ids(tok, [["what is here?"]])
    expanded1, _, out1 = run(engine, turn1, [first_pics[0][1]])
    answer = tok.decode(out1.output_ids, skip_special_tokens=True)
    second = picture(SIZES[2], seed=6)
    turn2 = chat_ids(tok, [["what is here?"], ["and here?"]], [answer])
    expanded2, mm2, out2 = run(engine, turn2, [first_pics[0][1], second[1]])
    # turn 2 starts with turn 1's expanded prompt: its K/V (images included) is reused
    assert expanded2[:len(expanded1)] == expanded1
    assert out2.meta_info.cached_tokens >= len(expanded1)
    want_ids, want_lp = hf_greedy(hf, vl_path, expanded2, [first_pics[0][0], second[0]], GREEDY.max_new_tokens)
    assert out2.output_ids == want_ids and lps(out2) == pytest.approx(want_lp, abs=1e-4)
    # the same ids with another first image: nothing reused past that image's first pad
    swapped = picture(SIZES[1], seed=7)
    expanded3, mm3, out3 = run(engine, turn2, [swapped[1], second[1]])
    assert expanded3 == expanded2 and out3.meta_info.cached_tokens <= mm3.images[0].offset
    want_ids, want_lp = hf_greedy(hf, vl_path, expanded3, [swapped[0], second[0]], GREEDY.max_new_tokens)
    assert out3.output_ids == want_ids and lps(out3) == pytest.approx(want_lp, abs=1e-4)


@pytest.mark.parametrize(("why", "ids_of", "urls_of", "says"), [
    ("more images than placeholders", lambda t, vs, ip, ve: t, lambda u: [u, u], "1 image placeholders but 2"),
    ("no image for a placeholder", lambda t, vs, ip, ve: t, lambda u: [], "1 image placeholders but 0"),
    ("pads sent expanded", lambda t, vs, ip, ve: [vs, ip, ip, ip, ip, ve] + t[3:], lambda u: [u], "expanded run"),
    ("a bare pad", lambda t, vs, ip, ve: [ip] + t, lambda u: [u, u], "not wrapped"),
    ("corrupt base64", lambda t, *_: t, lambda u: ["data:image/png;base64,@@@notbase64"], "corrupt base64"),
    ("bytes that are no image", lambda t, *_: t, lambda u: [base64.b64encode(b"hello, world" * 9).decode()],
     "Could not decode image"),
    ("a remote URL", lambda t, *_: t, lambda u: ["https://example.com/cat.png"], "inline only"),
])
def test_bad_image_requests_are_refused_with_a_reason(engine, tok, why, ids_of, urls_of, says) -> None:
    vs, ve, ip = (tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>"))
    ids = [vs, ip, ve] + tok("what?", add_special_tokens=False)["input_ids"]
    with pytest.raises(BadRequest, match=says):
        engine.prepare_images(ids_of(ids, vs, ip, ve), urls_of(picture((56, 56), 0)[1]))


def test_too_large_an_image_is_refused_before_it_is_decoded(engine, tok) -> None:
    from PIL import Image

    side = int(MAX_IMAGE_PIXELS ** 0.5) + 8
    buf = io.BytesIO()
    Image.new("1", (side, side)).save(buf, format="PNG")  # 1 bit a pixel: a small file of a huge image
    ids = tok("<|vision_start|><|image_pad|><|vision_end|>x", add_special_tokens=False)["input_ids"]
    with pytest.raises(BadRequest, match="pixels; at most"):
        engine.prepare_images(ids, [base64.b64encode(buf.getvalue()).decode()])


def test_a_text_only_model_refuses_images(tiny_model_path) -> None:
    eng = CPUEngine(EngineConfig(model_path=str(tiny_model_path), num_threads=1))
    try:
        with pytest.raises(BadRequest, match="text-only model"):
            eng.prepare_images([1, 2, 3], [picture((56, 56), 0)[1]])
    finally:
        eng.shutdown()


def test_http_generate_with_images_speaks_sglangs_contract(vl_path, tok, tmp_path) -> None:
    """Over real HTTP: SGLang's request shape (checked against SGLang 0.5.23's own JSON contract), its answer keys
    (``prompt_tokens`` counts the expanded prompt, ``image_tokens``, ``prompt_token_ids``), streamed and not, a
    batch with one image list a prompt; a bad image is SGLang's 400 body."""
    from tests._engine_helpers import engine_process
    from tests._sglang_source import api_types
    from tests.test_sglang_contract import _unknown_keys

    at = api_types()
    pics = [picture(SIZES[0], 1)[1], picture(SIZES[1], 2)[1]]
    ids = chat_ids(tok, [["one", "two"]])
    body = {"input_ids": ids, "image_data": pics, "return_prompt_token_ids": True, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}
    at.GenerateRequest.from_json_value(body)
    with engine_process(vl_path, tmp_path) as url:
        r = httpx.post(f"{url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        answer = r.json()
        at.GenerateResponse.from_json_value(answer)
        assert not _unknown_keys(at, answer)
        expanded = answer["prompt_token_ids"]
        assert answer["meta_info"]["image_tokens"] == 12 and answer["meta_info"]["prompt_tokens"] == len(expanded)
        assert len(expanded) == len(ids) - 2 + 12
        with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=120) as s:
            chunks = [json.loads(ln.removeprefix("data: ")) for ln in s.iter_lines() if ln and ln != "data: [DONE]"]
        assert chunks[-1]["output_ids"] == answer["output_ids"] and not _unknown_keys(at, chunks[-1])
        batch = {**body, "input_ids": [ids, ids], "image_data": [pics, pics[::-1]]}
        at.GenerateRequest.from_json_value(batch)
        both = httpx.post(f"{url}/generate", json=batch, timeout=120).json()
        assert both[0]["output_ids"] == answer["output_ids"] and both[1]["meta_info"]["image_tokens"] == 12
        bad = httpx.post(f"{url}/generate", json={**body, "image_data": [pics[0], "@@@"]}, timeout=60)
        assert bad.status_code == 400 and "IMAGE data at index 1" in bad.json()["error"]["message"]
        short = httpx.post(f"{url}/generate", json={**batch, "image_data": [pics]}, timeout=60)
        assert short.status_code == 400 and "batch size" in short.json()["error"]["message"]
