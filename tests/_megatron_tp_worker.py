"""One rank of the multi-process Megatron tests (run one copy per rank with torchrun-style env vars).

Loads an HF checkpoint into a TP/PP-sharded Megatron GPTModel and exports it back to HF names.
With TP only (pp=1) it also computes plain, packed and vocab-parallel logits. Each rank saves
its results to ``OUT.rank{rank}`` for the test to compare.
"""

from __future__ import annotations

import sys

import torch

torch.set_num_threads(1)


def main(hf_dir: str, inputs_path: str, out_path: str, tp_size: int, pp_size: int) -> None:
    from transformers import AutoConfig

    from slime_server.trainer.convert import export_hf_state_dict, load_hf_checkpoint_into
    from slime_server.trainer.model import build_gpt_model, forward_logits
    from slime_server.trainer.parallel import destroy_parallel, init_parallel

    layout = init_parallel(tp_size=tp_size, pp_size=pp_size)
    model = build_gpt_model(AutoConfig.from_pretrained(hf_dir)).eval()
    load_hf_checkpoint_into(model, hf_dir)
    result: dict = {"layout": layout.__dict__}
    if model.pre_process:
        result["vocab_rows"] = model.embedding.word_embeddings.weight.shape[0]
    if pp_size == 1:
        inputs = torch.load(inputs_path, weights_only=True)
        with torch.no_grad():
            result["logits"] = forward_logits(model, inputs["input_ids"])
            result["packed"] = forward_logits(model, inputs["packed_ids"], inputs["packed_positions"])
            result["local"] = forward_logits(model, inputs["input_ids"], gather=False)
    result["exported"] = export_hf_state_dict(model)
    torch.save(result, f"{out_path}.rank{layout.rank}")
    destroy_parallel()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
