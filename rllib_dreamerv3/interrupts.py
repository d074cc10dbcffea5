"""Ctrl-C during a long native call: the first call of a compiled TF function.

Python raises `KeyboardInterrupt` for SIGINT from its handler, which runs in the main thread
between two bytecodes. Calling a TF function is one bytecode; its first call compiles the
function with XLA inside that C++ call, so a Ctrl-C then took effect only once the compile and
the call had finished.

:func:`call` makes the main thread wait for such a call instead of making it: the call runs in
a helper thread, and the main thread blocks on a lock, a wait that a signal interrupts (the
handler runs at once and raises there). Nothing can stop the helper thread inside the compile;
it finishes the call in the background and its result is dropped. Two things keep it harmless:

- :func:`wait_for_abandoned`, called before the next native call and before a state is read
  or written (a checkpoint), lets it finish first, so nothing runs alongside it (a second
  Ctrl-C interrupts that wait too);
- if the interpreter exits while it still runs, its final teardown (which destroys the TF
  objects that the call is using) could wait for the call or break it, so a hook, registered
  at the interrupt, runs the remaining exit handlers (Ray's shutdown, temporary files,
  logging) and then ends the process as an uncaught `KeyboardInterrupt` does (SIGINT),
  skipping only that teardown.

Only the main thread's calls go through a helper: signals reach no other thread.
"""

import atexit
import os
import signal
import sys
import threading

# `threading.Event`s of the interrupted calls, set when the call has finished. (Not the
# threads: an interrupted `Thread.join` marks its thread as stopped, bpo-45274's fix, though
# it still runs; `is_alive()` and `join()` then no longer tell.)
_abandoned = []
_exit_hook = {"registered": False, "running": False}


def call(fn, *args):
    """`fn(*args)` such that Ctrl-C interrupts the main thread's wait for it at once."""
    wait_for_abandoned()
    if threading.current_thread() is not threading.main_thread():
        return fn(*args)
    outcome = {}
    go, done = threading.Event(), threading.Event()

    def run():
        go.wait()
        try:
            if not outcome.get("cancelled"):
                outcome["value"] = fn(*args)
        except BaseException as error:  # handed to the caller
            outcome["error"] = error
        finally:
            done.set()

    # A Ctrl-C can raise at any bytecode from here on, also inside `Thread.start` and on a busy
    # machine long after it (the signal may reach another thread; the main thread raises when it
    # next runs). The helper calls `fn` only once `go` is set: an interrupt before that cancels
    # the call (the helper returns at once), an interrupt after it abandons the running call.
    thread = threading.Thread(target=run, name="rllib_dreamerv3-native-call", daemon=True)
    try:
        thread.start()
        go.set()
        done.wait()
    except BaseException:  # KeyboardInterrupt, or another signal handler's exception
        if go.is_set():
            _abandon(done)
        else:
            outcome["cancelled"] = True
            go.set()
        raise
    if "error" in outcome:
        raise outcome.pop("error")
    return outcome.pop("value")


def call_directly(fn, *args):
    """`fn(*args)` in this thread, once the interrupted calls have finished."""
    if _abandoned:
        wait_for_abandoned()
    return fn(*args)


def wait_for_abandoned():
    """Wait until the interrupted calls have finished (at once when there are none)."""
    for done in list(_abandoned):  # a copy: another thread may be waiting too
        done.wait()
        if done in _abandoned:
            _abandoned.remove(done)


def _abandon(done):
    _abandoned.append(done)
    if not _exit_hook["registered"]:
        atexit.register(_exit_without_teardown)  # the latest exit handler runs first
        _exit_hook["registered"] = True


def _exit_without_teardown():
    if _exit_hook["running"] or all(done.is_set() for done in _abandoned):
        return
    _exit_hook["running"] = True
    atexit._run_exitfuncs()  # the others (this one returns at once when they call it)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing more to write there
            pass
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(128 + signal.SIGINT)  # if the signal did not end the process
