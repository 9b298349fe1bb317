"""`pretrain` with real weights started by hand as 2 gloo ranks (torchrun): rank 0 exports the weights unchanged, the
other rank returns; both exit 0 (tests/test_pretrain_weights_ranks.py: the same at `compute.nproc: 2` as one
process)."""
from __future__ import annotations

import sys

from test_pretrain_weights_ranks import export, project  # noqa: F401  (the module fixture)


def test_pretrain_with_weights_under_torchrun_2_ranks(project):  # noqa: F811
    export(project, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--"])
