"""Other libraries' routine lines stay out of our log, and ``--verbose`` (DEBUG) brings them back.

One process sets up our logging at INFO, then at DEBUG, and each time runs the library code that prints into
every ``qie`` run: DeepSpeed's accelerator detection (on a machine without a GPU), accelerate's checkpoint save,
transformers' ``past_key_values`` deprecation (DiffSynth's text encoder passes that argument) and its warnings
about a Qwen2.5-VL config written for transformers 4 (DiffSynth's text encoder config), and what
ProdigyPlusScheduleFree prints when it is built (the LBM recipe's optimizer).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import sys
from diffsynth_qie.utils.logging import setup_logging

for level, out_dir in (("INFO", sys.argv[1]), ("DEBUG", sys.argv[2])):
    setup_logging(level)
    print("=== " + level, flush=True)
    from deepspeed.accelerator import real_accelerator
    real_accelerator.ds_accelerator = None  # detect again: importing DeepSpeed detected it once already
    real_accelerator.get_accelerator()
    from accelerate import PartialState
    from accelerate.checkpointing import save_accelerator_state
    PartialState(cpu=True)
    save_accelerator_state(out_dir, [], [], [], [], 0, 0)
    from transformers.utils.deprecation import deprecate_kwarg

    @deprecate_kwarg("past_key_values", "99.0", new_name="cache")
    def forward(input_ids=None, cache=None):
        return input_ids

    forward(input_ids=1, past_key_values=None)
    from transformers import Qwen2_5_VLConfig

    rope = {"mrope_section": [2, 2, 4], "rope_type": "default", "type": "default"}  # as a transformers-4 config
    Qwen2_5_VLConfig(rope_scaling=rope, rope_theta=1e6, text_config=dict(rope_scaling=rope, rope_theta=1e6))
    import torch
    from diffsynth_qie.training.config import OptimConfig
    from diffsynth_qie.training.optim import build_optimizer

    build_optimizer([torch.nn.Parameter(torch.zeros(3))], OptimConfig(optimizer="prodigy_sf"))
    sys.stdout.flush()
    sys.stderr.flush()
"""
LINES = ("Setting accelerator to CPU", "Random states saved in", "`past_key_values` is deprecated",
         "got `key=rope_scaling` in kwargs", "Unrecognized keys in `rope_parameters`",
         "'split_groups' has been disabled")


def test_library_noise_is_quiet_without_verbose_and_shown_with_it(tmp_path):
    dirs = [tmp_path / "info", tmp_path / "debug"]
    for d in dirs:
        d.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": ""}
    env.pop("DS_ACCELERATOR", None)  # DeepSpeed detects, as in a plain `qie train`
    proc = subprocess.run([sys.executable, "-u", "-c", PROBE, *map(str, dirs)], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    quiet, verbose = proc.stdout.split("=== INFO", 1)[1].split("=== DEBUG", 1)
    assert [line for line in LINES if line in quiet] == [], quiet
    assert [line for line in LINES if line not in verbose] == [], verbose
    assert (dirs[0] / "random_states_0.pkl").is_file()  # the save itself ran in the quiet half
