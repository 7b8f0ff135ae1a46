"""One step counter a rank: after a resume, what p2p and ZeRO say names the true step."""

from __future__ import annotations

from pipezero.config import ScheduleKind as K
from pipezero.settings import build_config
from training import tiny_overrides


def test_a_resumed_run_names_the_true_step_everywhere(text_dir, tmp_path, monkeypatch):
    from pipezero.engine import train
    from pipezero.zero.sharded import ZeroDP

    seen: list[tuple[int, int]] = []
    clean = ZeroDP.begin_step

    def begin_step(self):
        clean(self)
        seen.append((self.step_no, self.comm.tracer.step))

    monkeypatch.setattr(ZeroDP, "begin_step", begin_step)
    out = str(tmp_path / "run")
    train(build_config(None, tiny_overrides(str(text_dir), out, 1, 1, K.ONE_F_ONE_B, 1,
                                            **{"run.max_steps": 2, "run.checkpoint_every": 2})))
    assert seen == [(1, 1), (2, 2)]
    seen.clear()
    from pipezero import stage as stage_module

    built = []
    monkeypatch.setattr("pipezero.engine.build_stage",
                        lambda *a, **k: built.append(stage_module.build_stage(*a, **k)) or built[-1])
    res = train(build_config(None, tiny_overrides(str(text_dir), out, 1, 1, K.ONE_F_ONE_B, 1,
                                                  **{"run.max_steps": 4, "run.resume": True})))
    assert res.resumed_from == 2
    assert seen == [(3, 3), (4, 4)]  # ZeRO's messages: step 1 and 2 before one counter
    stage = built[0]  # p2p's and ZeRO's waits name the step they read from the stage's one counter
    assert stage.executor.p2p.tracer is stage.tracer and stage.zero.comm.tracer is stage.tracer
    assert stage.tracer.step == 4
