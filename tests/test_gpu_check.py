"""examples/gpu_check.py --smoke runs (tiny shapes, CPU) and its one JSON has every section with sane values, so the
script is ready the day a GPU is lent."""

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("env", "target", "notes", "verify_ms", "round_split", "round_ops", "host_syncs", "identity")


def test_gpu_check_smoke(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_EAGLE2_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, os.path.join("examples", "gpu_check.py"), "--smoke", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == result
    assert result["smoke"] is True and all(key in result for key in SECTIONS), sorted(result)
    assert "tree_compile=True" in result["notes"]["compiled"]
    env_ = result["env"]
    assert env_["torch"] and env_["transformers"] and env_["hf_eagle2"] and env_["device"] == "cpu"
    curve = result["verify_ms"]
    assert list(curve["q_ms"]) == ["1", "2", "4", "8"] and all(ms > 0 for ms in curve["q_ms"].values())
    assert curve["head_step_ms"] > 0
    for name in ("accelerator_round", "accelerator_round_compiled", "budget_defaults"):
        split = result["round_split"][name]
        # wall_ms is a difference of two timed calls over their difference in rounds: noise can make the smoke's
        # tiny one negative on a loaded machine, so only its presence is checked here (the GPU run reads it)
        assert split["rounds"] > 0 and split["tau"] >= 1 and math.isfinite(split["wall_ms"]), (name, split)
        assert set(split["profiled_ms"]) == {"draft_model", "tree_build", "verify", "bookkeeping", "outside_target"}
        assert all(ms >= 0 for ms in split["profiled_ms"].values()), (name, split)
    assert result["round_split"]["accelerator_round"]["mean_tree_tokens"] > 1  # a fixed m=60 tree, cut by max depth
    ops, compiled = result["round_ops"]["eager"], result["round_ops"]["compiled"]
    assert ops["ops"] > 0 and ops["launches"] > 0 and isinstance(ops["host_reads"], (int, float))
    assert compiled["compiled_calls"] >= 1 and compiled["launches"] < ops["launches"]
    assert result["host_syncs"] is None  # CUDA's sync debug mode: null on a CPU
    assert result["identity"] == {"tree_ngram=0": True, "defaults": True, "accelerator_round_compiled": True}
