"""Loaded at start by every Python process whose PYTHONPATH names this folder (tests/test_verify.py
puts it there for one `pipezero verify` run): in the rank named by PIPEZERO_TEST_DRIFT
("RANK:PARAMETER"), the final copy of PARAMETER is nudged before verify writes it, so the test can
show that one drifted replica is caught and named. The hook lives here, not in the package: no
variable a user could set changes what pipezero computes."""

import os

_spec = os.environ.get("PIPEZERO_TEST_DRIFT", "")
if _spec and os.environ.get("RANK") == _spec.split(":", 1)[0]:  # a rank (torchrun sets RANK), not the launcher
    import torch

    import pipezero.verify as verify

    _name = _spec.split(":", 1)[1]
    _made = verify.RankResult

    def _drifted(rank, pp_rank, dp_rank, losses, grad_norms, params):
        p = params[_name]
        noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(0))
        p += 1e-3 * p.norm() / p.numel() ** 0.5 * noise
        return _made(rank, pp_rank, dp_rank, losses, grad_norms, params)

    verify.RankResult = _drifted
