"""Convert a Hugging Face checkpoint directory to a slime-server Megatron checkpoint directory.

    python tools/convert_hf_to_megatron.py --hf-dir HF_DIR --out-dir MEGATRON_DIR [--fused-norms]

Output format (``slime-megatron-v1``, see slime_server/trainer/convert_files.py):
``model.pt`` (torch.save of the full, un-sharded Megatron state dict with global layer indices),
``slime_megatron.json`` (metadata incl. the HF config) and ``hf/`` (tokenizer and config files).
``--fused-norms`` names the layer norms the TransformerEngine way (``linear_qkv.layer_norm_weight``).
Supported families: Llama, Qwen2, Qwen3. No GPU or torch.distributed needed.
"""

from __future__ import annotations

import argparse
import sys

from slime_server.trainer.convert_files import convert_hf_dir_to_megatron


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-dir", required=True, help="HF directory with config.json and *.safetensors")
    parser.add_argument("--out-dir", required=True, help="Megatron checkpoint directory to write")
    parser.add_argument("--fused-norms", action="store_true", help="TransformerEngine layer-spec names")
    args = parser.parse_args(argv)
    try:
        out = convert_hf_dir_to_megatron(args.hf_dir, args.out_dir, fused_norms=args.fused_norms)
    except (OSError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
