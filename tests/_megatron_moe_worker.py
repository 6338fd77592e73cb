"""One rank of the MoE model-parallel test (run one copy per rank with torchrun-style env vars): the checkpoint
under TP / EP, its logits (natural and replaying the given routes) for this rank's inputs, and its export back to
HF names. Each data-parallel rank takes its own inputs (TP ranks share theirs); each rank saves its results to
``OUT.rank{rank}``."""

from __future__ import annotations

import sys

import torch

torch.set_num_threads(1)


def main(hf_dir: str, inputs_path: str, out_path: str, tp_size: int, ep_size: int) -> None:
    from transformers import AutoConfig

    from slime_server.trainer import routing_replay
    from slime_server.trainer.convert import export_hf_state_dict, load_hf_checkpoint_into
    from slime_server.trainer.model import build_gpt_model, forward_logits
    from slime_server.trainer.parallel import destroy_parallel, init_parallel

    layout = init_parallel(tp_size=tp_size, ep_size=ep_size)
    model = build_gpt_model(AutoConfig.from_pretrained(hf_dir)).eval()
    load_hf_checkpoint_into(model, hf_dir)
    mine = torch.load(inputs_path, weights_only=True)[layout.dp_rank]  # TP ranks share inputs; DP (EP) ranks do not
    result: dict = {"layout": layout.__dict__, "experts": len(model.decoder.layers[0].mlp.experts.local_experts)}
    with torch.no_grad():
        result["logits"] = forward_logits(model, mine["ids"])
        with routing_replay.replaying(model, mine["forced"]):
            result["replayed"] = forward_logits(model, mine["ids"])
    result["exported"] = export_hf_state_dict(model)
    torch.save(result, f"{out_path}.rank{layout.rank}")
    destroy_parallel()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
