"""tools/baselines/torchtune_baseline: the optimizer stepped inside the backward is the same
AdamW as a plain loop's, and no set of gradients outlives the backward."""

from __future__ import annotations

import torch

from tests.conftest import tiny_config
from tests.test_swap_equivalence import rel_err
from tools.baselines import torchtune_baseline as tt


def test_optimizer_in_backward_equals_a_plain_adamw_loop():
    cfg = tiny_config(model={"arch": "llama", "n_kv_head": 2, "n_layer": 3})
    cpu = torch.device("cpu")
    mine = tt.build(cfg, cpu, torch.float32)
    ref = tt.build(cfg, cpu, torch.float32)
    _, factory = tt.make_optimizer("adamw", cfg)
    tt.OptimizerInBackward(mine, factory)
    plain = factory(list(ref.parameters()))
    for x, y in tt.batches(cfg, 2, 3, cpu):
        tt.loss_of(mine, x, y).backward()
        assert all(p.grad is None for p in mine.parameters())  # stepped and dropped
        plain.zero_grad(set_to_none=True)
        tt.loss_of(ref, x, y, recompute=False).backward()
        plain.step()
    got, want = dict(mine.named_parameters()), dict(ref.named_parameters())
    start = dict(tt.build(cfg, cpu, torch.float32).named_parameters())
    for name, p in want.items():
        assert not torch.equal(p, start[name]), name  # it trained
        assert rel_err(got[name].detach(), p.detach()) <= 1e-5, name


def test_the_baseline_reports_what_ran(capsys):
    import json

    assert tt.main(["--config", "tiny", "--steps", "2", "--batch", "2", "--device", "cpu",
                    "--optimizer", "adamw"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["optimizer"] == "torch AdamW" and out["dtype"] == "bfloat16"
    assert out["tokens_per_s"] > 0 and len(out["losses"]) == 2
