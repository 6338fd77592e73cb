"""Convert a slime-server Megatron checkpoint directory back to a Hugging Face directory.

    python tools/convert_megatron_to_hf.py --megatron-dir MEGATRON_DIR --out-dir HF_DIR

Reads the ``slime-megatron-v1`` format written by tools/convert_hf_to_megatron.py (see
slime_server/trainer/convert_files.py) and writes config/tokenizer files plus
``model.safetensors``, loadable with ``AutoModelForCausalLM.from_pretrained``. The conversion
is exact: HF -> Megatron -> HF gives bit-identical tensors.
"""

from __future__ import annotations

import argparse
import sys

from slime_server.trainer.convert_files import convert_megatron_dir_to_hf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-dir", required=True, help="directory written by convert_hf_to_megatron")
    parser.add_argument("--out-dir", required=True, help="HF directory to write")
    args = parser.parse_args(argv)
    try:
        out = convert_megatron_dir_to_hf(args.megatron_dir, args.out_dir)
    except (OSError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
