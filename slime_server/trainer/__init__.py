"""The trainer: Megatron-core ranks, the HF<->Megatron mapping, losses, advantages, packing, checkpoints, the
bucketed weight push and the loop. Importing the package first keeps Megatron's fusions eager on CPU
(``fusions.py``), before any module here imports Megatron."""

from slime_server.trainer.fusions import install as _install_eager_fusions

_install_eager_fusions()
