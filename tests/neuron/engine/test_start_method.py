"""How engine processes and ranks start (helexa/neuron/engine/start_method.py): spawn by
default, forkserver on request, a child of either seeing the environment and the stderr of
the process that started it as they are at its start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helexa.neuron.engine import start_method


def test_an_unknown_start_method_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(start_method.ENV, "fork")
    with pytest.raises(ValueError, match=r"^HELEXA_ENGINE_START: expected one of spawn, "
                                         r"forkserver, got `fork`$"):
        start_method.context()
    with pytest.raises(ValueError, match=r"^expected one of spawn, forkserver, got `fork`$"):
        start_method.set_default("fork")


def test_spawn_is_the_default_where_nothing_chose_another():
    """What a neuron runs, unless HELEXA_ENGINE_START says otherwise (this suite's own
    engines fork: tests/conftest.py)."""
    code = "from helexa.neuron.engine import start_method as m; print(m.context()._name)"
    env = {k: v for k, v in os.environ.items() if k != start_method.ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.stdout.split() == ["spawn"], out.stderr


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_child_sees_the_environment_and_stderr_it_was_started_with(monkeypatch, capfd,
                                                                    method):
    """The variable is set, and pytest's capture of stderr begun, after the forkserver (if
    any) was running already for another child: the child sees both."""
    monkeypatch.setenv(start_method.ENV, method)

    def run(command: str) -> int | None:
        ctx = start_method.context()
        fn, args = start_method.target(ctx, os.system, (command,))
        p = ctx.Process(target=fn, args=args)
        p.start()
        p.join(60)
        return p.exitcode

    monkeypatch.delenv("HELEXA_PROBE", raising=False)
    with capfd.disabled():  # a forkserver started here writes to pytest's own stderr
        assert run("true") == 0
    monkeypatch.setenv("HELEXA_PROBE", "set-later")
    assert run('echo "seen:$HELEXA_PROBE" >&2') == 0
    assert capfd.readouterr().err.splitlines() == ["seen:set-later"]


# ~20 s each on 2 cores (an interpreter importing torch, then a rank): the way a neuron
# runs by default, and the suite's own way only with -m slow
@pytest.mark.parametrize("method", ["spawn", pytest.param("forkserver", marks=pytest.mark.slow)])
def test_no_rank_outlives_the_process_that_started_it(tiny_model_dir, method):
    """Rank 0's process ends without any cleanup: its rank 1 is gone soon after, whether
    the rank was spawned (its parent is rank 0's process) or forked from the server."""
    from test_tp import wait_gone

    code = (
        "import os, sys\n"
        "from helexa.neuron.engine.model_runner import ModelRunner\n"
        "if __name__ == '__main__':\n"
        f"    r = ModelRunner({str(tiny_model_dir)!r}, num_blocks=8, block_size=8,\n"
        "                    max_num_seqs=1, max_batched_tokens=64, tp_size=2)\n"
        "    print(r.tp_pids[0], flush=True)\n"
        "    os._exit(0)  # no cleanup at all, as if killed\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).parents[3],
                         env={**os.environ, start_method.ENV: method})
    assert out.returncode == 0, out.stderr
    assert wait_gone(int(out.stdout.split()[-1]))
