"""attnlab-average: a tiny run keeping its checkpoints, the mean of its last three written and
evaluated beside the last; too few checkpoints is one line."""

from __future__ import annotations

import json

import torch

from conftest import TINY, assert_ok, assert_user_error, run_cli, run_dirs


def test_average_of_the_last_three_checkpoints_is_their_mean_and_is_evaluated(tmp_path):
    keep = ["callbacks.model_checkpoint.save_top_k=-1", "trainer.max_steps=3", "trainer.val_check_interval=1"]
    assert_ok(run_cli("train", [*TINY, "task_name=avg", "logger=csv", *keep], tmp_path))
    (run,) = run_dirs(tmp_path, "avg")
    proc = run_cli("average", [str(run), "--last", "3", "trainer.accelerator=cpu"], tmp_path)
    assert_ok(proc)

    def weights(name: str) -> dict[str, torch.Tensor]:
        return torch.load(run / "checkpoints" / name, weights_only=True)["state_dict"]

    states = [weights(f"step_{s:06d}.ckpt") for s in (1, 2, 3)]
    averaged = weights("average_last3.ckpt")
    assert averaged.keys() == states[-1].keys()
    for key, value in averaged.items():
        if value.is_floating_point():
            mean = (sum(s[key].double() for s in states) / 3).to(value.dtype)
            assert torch.equal(value, mean), key
            assert not torch.equal(value, states[-1][key]) or torch.equal(states[0][key], states[-1][key])
        else:  # counters: the last's
            assert torch.equal(value, states[-1][key]), key
    lines = proc.stdout.splitlines()  # a header and two rows: the last checkpoint, then the average
    assert lines[0].split()[:1] == ["checkpoint"] and "val/loss" in lines[0] and "test/loss" in lines[0]
    assert lines[1].startswith("step_000003.ckpt (steps 3)") and lines[2].startswith(
        "average_last3.ckpt (steps 1, 2, 3)"
    )
    report = json.loads((run / "average_last3.json").read_text())
    assert report["average"]["steps"] == [1, 2, 3] and report["last"]["checkpoint"] == "step_000003.ckpt"
    assert all({"val/loss", "test/loss"} <= report[row]["metrics"].keys() for row in ("last", "average"))

    assert_user_error(
        run_cli("average", [str(run), "--last", "5"], tmp_path),
        f"{run / 'checkpoints'}: 3 checkpoint(s), --last 5 needs 5",
        "save_top_k=-1",
    )


def test_floats_are_averaged_and_counters_copied_from_the_last():
    from attnlab.weights.averaging import average_state_dicts

    states = [{"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(k)} for k in (3, 5, 8)]
    states[2]["w"] = torch.tensor([4.0, 5.0], dtype=torch.float32)
    averaged = average_state_dicts(states)
    assert torch.equal(averaged["w"], torch.tensor([2.0, 3.0])) and averaged["w"].dtype == torch.float32
    assert averaged["n"].item() == 8 and averaged["n"].dtype == torch.int64
