"""What a screenshot-driven agent session costs the gateway per turn, beside a text-only session of as many turns.

A computer-use agent sends a screenshot every turn and resends the whole conversation (every earlier screenshot
with it). Per turn this times what the gateway does before and after the engine: reading the request's images
(base64, content hash, format and size checks for a file not seen lately, pad count: ``gateway/images.ImageReader``), preparing the prompt
(render, expand, find the trajectory it extends: ``SessionManager.prepare_turn``) and committing the answer (with the
new image file, once per content hash: ``commit_turn``), against a real SQLite store and the tiny VLM's tokenizer
and template. The text session sends a tool-output-sized text instead of each screenshot. Also printed: the bytes
each screenshot adds to the store (the database file's growth over the session, divided by the images).

    python tools/bench_vision_session.py --turns 10
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slime_server.buffer.open import open_store  # noqa: E402
from slime_server.gateway.chat_template import ChatRenderer  # noqa: E402
from slime_server.gateway.images import ImageReader, TurnImages  # noqa: E402
from slime_server.gateway.sessions import ChoiceResult, SessionManager  # noqa: E402
from slime_server.models.tiny_vl import ensure_tiny_vl_model  # noqa: E402


def screenshot(seed: int, width: int, height: int) -> bytes:
    """A synthetic desktop: windows, buttons and text lines on a flat background, as PNG (compresses like one)."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    img = Image.new("RGB", (width, height), (236, 239, 244))
    draw = ImageDraw.Draw(img)
    for _ in range(12):
        x, y = rng.randrange(width - 200), rng.randrange(height - 120)
        draw.rectangle((x, y, x + rng.randint(120, 400), y + rng.randint(60, 300)), fill=(255, 255, 255),
                       outline=(rng.randrange(256), rng.randrange(256), rng.randrange(256)))
        for k in range(6):
            draw.text((x + 8, y + 8 + 14 * k), " ".join(rng.choice("ok cancel file edit view run") for _ in range(5)),
                      fill=(20, 20, 20))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def one_session(model: Path, turns: int, images: bool, seed: int, size: tuple[int, int]) -> list[tuple[float, float, float]]:
    """(read ms, prepare ms, commit ms) per turn; the store's size growth per image in ``one_session.bytes``."""
    renderer = ChatRenderer(model)
    folder = Path(tempfile.mkdtemp(prefix="bench_vision_"))
    store = open_store(folder / "trajectories.db")
    sessions = SessionManager(store, renderer)
    reader = ImageReader(renderer.vision, "tiny-vl", fetch_urls=False, max_bytes=20 * 2**20, stored=store.get_images)
    rng = random.Random(seed)
    messages: list[dict] = [{"role": "system", "content": "You operate a computer."},
                            {"role": "user", "content": "Open the settings and turn on dark mode."}]
    rows = []
    start_size = _db_bytes(folder)
    for k in range(turns):
        if images:
            url = "data:image/png;base64," + base64.b64encode(screenshot(seed * 1000 + k, *size)).decode()
            messages.append({"role": "user", "content": [{"type": "text", "text": f"Screen after step {k}:"},
                                                         {"type": "image_url", "image_url": {"url": url}}]})
        else:
            messages.append({"role": "user", "content": f"Screen after step {k}: " + " ".join(
                rng.choice("ok cancel file edit view run window button".split()) for _ in range(60))})
        t0 = time.perf_counter()
        turn_images = TurnImages()
        canonical = asyncio.run(reader.canonical(messages, turn_images))
        t1 = time.perf_counter()
        prepared = sessions.prepare_turn("bench", canonical, None)
        prepared._images = [turn_images.blobs[h] for h in turn_images.new]
        t2 = time.perf_counter()
        answer = f"click({rng.randrange(1000)}, {rng.randrange(700)})"
        ids = renderer.encode(answer) + [renderer.eos_token_id]
        choice = ChoiceResult(output_ids=ids, output_logprobs=[-0.1] * len(ids), weight_version=1, finish_reason="stop",
                              message={"role": "assistant", "content": answer}, response_id=f"resp-{k}")
        t3 = time.perf_counter()
        sessions.commit_turn(prepared, [choice])
        t4 = time.perf_counter()
        rows.append(((t1 - t0) * 1000, (t2 - t1) * 1000, (t4 - t3) * 1000))
        messages.append({"role": "assistant", "content": answer})
    store.close()
    one_session.bytes = (_db_bytes(folder) - start_size) / turns  # type: ignore[attr-defined]
    return rows


def _db_bytes(folder: Path) -> int:
    return sum(os.path.getsize(p) for p in folder.iterdir() if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3, help="each turn's times: the median of this many sessions")
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=720)
    args = ap.parse_args()
    model = ensure_tiny_vl_model()
    size = (args.width, args.height)
    vis, txt, per_turn = [], [], []
    for seed in range(args.repeat):
        vis.append(one_session(model, args.turns, True, seed, size))
        per_turn.append(one_session.bytes)  # type: ignore[attr-defined]
        txt.append(one_session(model, args.turns, False, seed, size))
    png = len(screenshot(0, *size))
    print(f"tiny VLM, {args.turns} turns, a {args.width}x{args.height} PNG screenshot each (~{png // 1024} KiB; the "
          f"tiny model's processor makes it 64 tokens); median of {args.repeat} sessions, ms")
    print("| turn | read images | prepare | commit | text session: prepare | commit |")
    print("|---|---|---|---|---|---|")
    for k in range(args.turns):
        med = [statistics.median(r[k][i] for r in vis) for i in range(3)]
        tmed = [statistics.median(r[k][i] for r in txt) for i in (1, 2)]
        print(f"| {k + 1} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f} | {tmed[0]:.2f} | {tmed[1]:.2f} |")
    print(f"\nstore growth per screenshot turn: {statistics.median(per_turn) / 1024:.1f} KiB "
          f"(the PNG itself: {png / 1024:.1f} KiB)")


if __name__ == "__main__":
    main()
