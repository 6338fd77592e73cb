"""One rank of the multi-process weight-push test (torchrun-style env vars; gloo on CPU).

Builds the tiny model with TP=2 (or PP=2), changes every local shard, and pushes with ``sender=None`` so the
rank decides for itself whether it sends (PP: the later stage streams its tensors to the first). Saves what it
did to ``OUT.rank{rank}``.
"""

from __future__ import annotations

import sys

import torch

torch.set_num_threads(1)


def main(hf_dir: str, engine_url: str, out_path: str, tp_size: int, pp_size: int = 1) -> None:
    from transformers import AutoConfig

    from slime_server.trainer.convert import export_hf_state_dict, load_hf_checkpoint_into
    from slime_server.trainer.model import build_gpt_model
    from slime_server.trainer.parallel import destroy_parallel, init_parallel
    from slime_server.trainer.pipeline import pipeline_hf_tensors
    from slime_server.trainer.weight_push import WeightPusher

    layout = init_parallel(tp_size=tp_size, pp_size=pp_size)
    model = build_gpt_model(AutoConfig.from_pretrained(hf_dir)).eval()
    load_hf_checkpoint_into(model, hf_dir)
    gen = torch.Generator().manual_seed(100 + layout.rank)  # every shard changes differently
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    with WeightPusher([engine_url], bucket_bytes=2**20) as pusher:
        stats = pusher.push(pipeline_hf_tensors(model), version=f"tp{tp_size}pp{pp_size}")
    exported = export_hf_state_dict(model)
    torch.save({"stats": stats.model_dump(), "exported": exported, "layout": layout.__dict__},
               f"{out_path}.rank{layout.rank}")
    destroy_parallel()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]) if len(sys.argv) > 5 else 1)
