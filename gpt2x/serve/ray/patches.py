"""The three patches of private Ray functions that `gpt2x serve` on Ray needs, in one place (Ray has no
public way to do either). tests/serve/test_ray_patches.py checks, against the Ray installed, that the
names patched exist with the shape expected and that each patch takes effect, so that a Ray release
that breaks them fails there rather than in a stop that no longer works.

- `ray_processes_in_their_own_session`: the local Ray instance's processes start sessions of their
  own, so that a signal sent to the server's process group reaches the driver alone, which then stops
  the application and Ray in order (sent to them too, it would take the GCS down under Ray Serve).
- `rays_sigterm_handlers_left_out`: ray.init installs no SIGTERM handler of its own in this process
  (they exit on the spot, half-way through whatever runs).
- `rays_driver_output_on_stderr`: what Ray prints in this process (its workers' output relayed, and its
  raylet's reports, such as a replica that died) goes to stderr: stdout carries `--json`'s ready line alone.
"""

from __future__ import annotations

import logging
import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ray._private import services as ray_services  # Ray's process launcher: ConsolePopen
from ray._private import utils as ray_utils  # where Ray installs its SIGTERM handlers: set_sigterm_handler
from ray._private import worker as ray_worker  # where a driver prints what Ray relays to it: print_to_stdstream

from ..replica import STOP_SIGNALS

log = logging.getLogger(__name__)


@contextmanager
def ray_processes_in_their_own_session(started: list[subprocess.Popen]) -> Iterator[None]:
    """Ray's processes started meanwhile (ray.init's local instance: GCS, raylet, log monitor, and the
    raylet's agents and workers after them) each start a session of their own (setsid), out of this
    process's group: a signal sent to the group (a process manager's SIGTERM, a terminal's Ctrl-C)
    reaches this process, which stops them in order, and not them. They still die with this process
    where Ray shares their fate with it (Linux: a parent-death signal). Each process started is added
    to `started` (its group is its own: `end_process_groups` ends what ray.shutdown left, or what an
    interrupted ray.init had started). Ray starts them through `ray._private.services.ConsolePopen`;
    where a Ray release has none, nothing changes (a warning)."""
    original = getattr(ray_services, "ConsolePopen", None)  # no public way to choose their session
    if not (isinstance(original, type) and issubclass(original, subprocess.Popen)):
        log.warning("this Ray release starts its processes without ConsolePopen; a signal sent to this "
                    "process's group reaches them too")
        yield
        return

    class OwnSession(original):
        def __init__(self, *args, **kwargs):
            kwargs["start_new_session"] = True
            kwargs["preexec_fn"] = _unblocking(kwargs.get("preexec_fn"))
            super().__init__(*args, **kwargs)
            started.append(self)

    ray_services.ConsolePopen = OwnSession
    try:
        yield
    finally:
        ray_services.ConsolePopen = original


@contextmanager
def rays_sigterm_handlers_left_out() -> Iterator[None]:
    """ray.init without its SIGTERM handlers in this process (`ray._private.utils.set_sigterm_handler`,
    called by ray.init and by the local node it starts: they exit on the spot, half-way through
    whatever runs, or tear the node down behind Ray Serve's back); the process's own stay in place, and
    a stop is theirs to make, in order."""
    original = getattr(ray_utils, "set_sigterm_handler", None)  # no public way to leave them out
    if original is None:
        yield
        return
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = original


@contextmanager
def rays_driver_output_on_stderr() -> Iterator[None]:
    """Meanwhile, what Ray prints in this process goes to stderr: the output of its workers that it relays
    (their stdout included) and its raylet's reports (a replica killed, a task retried), which it would print
    on stdout (`ray._private.worker.print_to_stdstream`, which the driver's threads look up when they print,
    and ray.init binds for the relayed output: ray.init runs inside)."""
    original = getattr(ray_worker, "print_to_stdstream", None)  # no public way to choose the stream
    if original is None:
        yield
        return

    def to_stderr(data: dict, ignore_prefix: bool) -> None:
        original({**data, "is_err": True}, ignore_prefix)

    ray_worker.print_to_stdstream = to_stderr
    try:
        yield
    finally:
        ray_worker.print_to_stdstream = original


def _unblocking(preexec: Callable[[], None] | None) -> Callable[[], None]:
    """A child's preexec_fn that first unblocks the stop signals (blocked here while ray.init runs,
    and a child inherits its parent's mask), then does what Ray's own does (it blocks SIGINT)."""
    def run() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        if preexec is not None:
            preexec()
    return run
