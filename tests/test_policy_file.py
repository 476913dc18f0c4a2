"""The policy file (``--policy``): its keys map onto the gate's rules, flags override it, and a
policy that fails fails the run for real."""

from __future__ import annotations

import pytest

from inprocess import run_pytest
from specparity.gate import exitcodes
from specparity.model.locations import REPO_ROOT
from specparity.cli.options import build_setup
from specparity.run.setup import BadInput
from specparity.gate.policy_file import PolicyError, load_policy, merge
from prompt_subsets import SHORT, first_of_each

#: The gate runs below: a short token budget, calibrated on the prompts that run.
SELECT = ("--calibration", "selected", *SHORT)


def write(tmp_path, text: str):
    path = tmp_path / "policy.toml"
    path.write_text(text)
    return path


def test_keys_map_onto_the_rules(tmp_path):
    path = write(tmp_path, '[gate]\nfail_on = ["diverged", "error", "near_tie"]\nmax_near_tie = 0.1\n'
                           'min_accept_length = 2.5\nrequire_all_paths = 3\nallow_unknown_activity = true\n')
    assert load_policy(path) == {"drift_policy": "warn", "bit_exact": True, "max_near_tie": 0.1,
                                 "min_accept_length": 2.5, "require_all_paths": 3, "allow_unknown_activity": True}


def test_the_committed_policy_loads():
    policy = build_setup({"policy": str(REPO_ROOT / "ci" / "policy.toml")}).config.policy
    assert policy.drift == "fail" and policy.min_accept_length is not None


def test_flags_override_the_file(tmp_path):
    path = write(tmp_path, '[gate]\nfail_on = ["diverged", "error", "drifted", "near_tie"]\nmax_near_tie = 0.1\n')
    policy = build_setup({"policy": str(path), "max_near_tie": "0.5", "allow_near_tie": True}).config.policy
    assert policy.max_near_tie == 0.5 and policy.bit_exact is False
    assert merge({"max_near_tie": None}, {"max_near_tie": 0.2}) == {"max_near_tie": 0.2}


@pytest.mark.parametrize("text, expected", [
    ("[gate]\nfail_on = ['diverged']\n", "policy.toml:2: fail_on: expected a list that includes diverged and error"),
    ("[gate]\nfail_on = ['diverged', 'error', 'exact']\n", "policy.toml:2: fail_on: expected a list of classes"),
    ("[gate]\nmax_near_tie = 2\n", "policy.toml:2: max_near_tie: expected a fraction in [0, 1], got 2"),
    ("[gate]\nrequire_all_paths = -1\n", "policy.toml:2: require_all_paths: expected an integer >= 0"),
    ("[gate]\nallow_unknown_activity = 1\n", "policy.toml:2: allow_unknown_activity: expected true or false"),
    ("[gates]\nmax_near_tie = 0.1\n", "policy.toml:1: expected one table [gate]"),
    ("[gate]\n\nmin_acceptance = 1\n", "policy.toml:3: min_acceptance: unknown key"),
])
def test_mistakes_name_file_line_and_key(tmp_path, text, expected):
    with pytest.raises(PolicyError, match=None) as err:
        load_policy(write(tmp_path, text))
    assert expected in str(err.value)
    with pytest.raises(BadInput):
        build_setup({"policy": str(tmp_path / "policy.toml")})


def gate(*args: str) -> tuple[int, str]:
    """``pytest suites/lossless ARGS`` in this process (tests/inprocess.py)."""
    return run_pytest("-q", "suites/lossless", *SELECT, *args)


@pytest.mark.slow
def test_acceptance_floor_fails_the_run(tmp_path, capsys):
    from specparity.cli import commands as cli

    # the floor is a rule over the run, not over a prompt: one math prompt takes its path
    prompts = ("--prompts", str(tmp_path / "math.jsonl"))
    first_of_each(tmp_path / "math.jsonl", ("math",))
    floor = write(tmp_path, "[gate]\nmin_accept_length = 99\n")
    code, out = gate(*prompts, "--policy", str(floor), "--report", str(tmp_path / "r"))
    assert code == exitcodes.GATE_FAILED, out[-2000:]
    assert "acceptance floor: mean accept length" in out and "min_accept_length 99" in out
    # the same prompts under a floor they clear: `specparity run` in-process (the same options and runner)
    code = cli.main(["run", *prompts, *SELECT, "--policy", str(write(tmp_path, "[gate]\nmin_accept_length = 1.0\n")),
                     "--report", str(tmp_path / "r2")])
    out = capsys.readouterr().out
    assert code == exitcodes.PASS, out[-2000:]
