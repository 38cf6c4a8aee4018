"""The preemption signal's setting: --preempt-signal, else FLODL_PREEMPT_SIGNAL, else USR1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from flodl_async.cli.launchargs import parse_args
from flodl_async.errors import ConfigError
from flodl_async.net.signals import preempt_signal
from flodl_async.training.savedesk import SaveDesk
from flodl_async.training.saves import PREEMPT, SHUTDOWN, SaveClock
from flodl_async.training.spec import Checkpointing


@pytest.mark.parametrize(
    ("text", "sig"),
    [(None, signal.SIGUSR1), ("", signal.SIGUSR1), ("usr2", signal.SIGUSR2),
     ("SIGHUP", signal.SIGHUP), (str(int(signal.SIGUSR2)), signal.SIGUSR2)],
)  # fmt: skip
def test_a_signal_by_name_or_number(text: str | None, sig: signal.Signals) -> None:
    assert preempt_signal(text) is sig


@pytest.mark.parametrize("text", ["TERM", "int", "KILL", "nonsense"])
def test_a_stop_an_uncatchable_or_no_signal_is_refused_naming_the_source(text: str) -> None:
    with pytest.raises(ConfigError, match="FLODL_PREEMPT_SIGNAL"):
        preempt_signal(text, source="FLODL_PREEMPT_SIGNAL")


def test_the_flag_wins_over_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLODL_PREEMPT_SIGNAL", "USR2")
    assert parse_args(["--nproc", "1", "--", "true"]).preempt_signal is signal.SIGUSR2
    args = parse_args(["--nproc", "1", "--preempt-signal", "HUP", "--", "true"])
    assert args.preempt_signal is signal.SIGHUP
    monkeypatch.setenv("FLODL_PREEMPT_SIGNAL", "TERM")
    with pytest.raises(ConfigError, match="FLODL_PREEMPT_SIGNAL: SIGTERM cannot mean"):
        parse_args(["--nproc", "1", "--", "true"])


@pytest.mark.parametrize("on_shutdown", [True, False])
def test_a_preempting_stop_saves_a_preempt_bundle_whatever_on_shutdown_says(
    tmp_path: object, on_shutdown: bool
) -> None:
    desk = SaveDesk(None, world_size=2)
    desk.clock = SaveClock(Checkpointing(save_path=str(tmp_path), on_shutdown=on_shutdown))
    plain = desk.final_reason(natural=False, from_controller=False, on_shutdown=on_shutdown)
    assert plain == (SHUTDOWN if on_shutdown else None)
    desk.preempting = True
    assert desk.final_reason(natural=False, from_controller=False, on_shutdown=on_shutdown) == (
        PREEMPT
    )


def test_a_trainer_rank_leaves_the_preemption_signal_to_its_launcher() -> None:
    """SLURM's --signal without B: signals the ranks too: a Trainer rank ignores SIGUSR1/SIGUSR2
    and the run's preemption signal (it lives on), but keeps a handler the program installed."""
    code = (
        "import os, signal, sys\n"
        "from flodl_async.trainer.rank import leave_preemption_to_the_launcher\n"
        "seen = []\n"
        "signal.signal(signal.SIGUSR2, lambda *a: seen.append('usr2'))\n"
        "leave_preemption_to_the_launcher()\n"
        "for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):\n"
        "    os.kill(os.getpid(), sig)\n"
        "print('alive', seen)\n"
    )
    env = {**os.environ, "FLODL_PREEMPT_SIGNAL": "HUP"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "alive ['usr2']"
