"""A preloaded launcher for the processes the tests start: the project's commands forked from a process that has
already imported torch and the project, instead of a fresh interpreter each.

Why: the suite is CPU-bound on CI's 2 cores, and it starts some hundreds of `python -m broker_server.cli ...`,
`protofl-edge join ...` and similar processes; each fresh one spends 1.5-4 s of CPU importing torch and the project
before it does anything (bench/suite_profile.py measures it). Forked from a process that holds those modules, a
command starts in milliseconds.

What stays real: each command is still its own OS process with its own pid, file descriptors, environment, working
directory and exit status; signals (SIGKILL included) reach it directly; its output goes to the pipes or files the
test gave it. What differs from `exec`: the modules imported before the fork are already in memory (so an
environment variable a module reads when it is imported is the launcher's, which is why such variables send a
command down the ordinary path, see `_IMPORT_TIME`), the hash seed is the launcher's, and /proc/PID/cmdline shows
the launcher's command line. Where any of that matters (faketime's LD_PRELOAD, a torch-less `-c` run, crash
injection read at import, another interpreter) the command is started the ordinary way: see `LaunchingPopen`.

Set PROTOFL_TEST_NO_LAUNCHER=1 to start every process the ordinary way.

Two halves:
- `serve()`: the launcher process (one per pytest worker, started on first use): imports, then forks a child for
  each request on its Unix socket and reports the child's pid, then its wait status.
- `LaunchingPopen`: a `subprocess.Popen` whose eligible commands go to the launcher; tests/conftest.py installs it
  as `subprocess.Popen` in the pytest workers, so `subprocess.run`/`Popen` in tests and in code they call use it.
"""

from __future__ import annotations

import atexit
import errno
import importlib
import io
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

from tests.launcher_client import send_request

DISABLE = "PROTOFL_TEST_NO_LAUNCHER"
_PACKAGES = frozenset({"protofl", "edge_agent", "broker_server", "export", "bench", "tests"})
# Console scripts the launcher runs (pyproject.toml's [project.scripts]), when PATH finds them in this venv.
_SCRIPTS = {
    "protofl-server": "broker_server.cli:app",
    "protofl-edge": "edge_agent.cli:app",
    "protofl-export": "export.cli:app",
}
# Variables read when a module is imported (by the project, torch's OpenMP, typer): a command whose value differs
# from the launcher's goes the ordinary way. Prefixes.
_IMPORT_TIME = (
    "PROTOFL_CRASH_",
    "LD_",
    "FAKETIME",
    "OMP_",
    "MKL_",
    "KMP_",
    "GOMP_",
    "OPENBLAS_",
    "TORCH_",  # TORCH_LOGS and the like, read when torch is imported (not TORCHINDUCTOR_*, which dynamo sets itself)
    "PYTORCH_",
    "CUDA",
    "TERMINAL_WIDTH",
    "FORCE_COLOR",
    "NO_COLOR",
    "_TYPER",
    "GITHUB_ACTIONS",
)
# PYTHON* variables a forked child honours itself; any other that differs sends the command the ordinary way.
# (PYTHONBREAKPOINT is read at each breakpoint(); Ray's driver sets it in the worker's environment.)
_PYTHON_HANDLED = frozenset(
    {"PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "PYTHONIOENCODING", "PYTHONBREAKPOINT"}
)
_PRELOAD = (
    "numpy",
    "torch",
    "torch.nn",
    "torch.optim",
    "onnxruntime",
    "paho.mqtt.client",
    "msgpack",
    "typer",
    "rich.console",
    "broker_server.cli",
    "edge_agent.cli",
    "export.cli",
)
# Modules run as __main__ must not be in sys.modules when runpy runs them (it warns): their imports stay cached.
_RUN_AS_MAIN = ("broker_server.cli", "edge_agent.cli", "export.cli")


# -- the launcher process ------------------------------------------------------------------------------------------


def _recv_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    conn.settimeout(30)
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
    while len(data) < 4:
        more = conn.recv(1 << 16)
        if not more:
            raise EOFError("request cut short")
        data += more
    (size,) = struct.unpack("!I", data[:4])
    while len(data) < 4 + size:
        more = conn.recv(1 << 16)
        if not more:
            raise EOFError("request cut short")
        data += more
    conn.settimeout(None)
    return json.loads(data[4 : 4 + size]), list(fds)


def _send_line(conn: socket.socket, obj: dict[str, Any]) -> None:
    try:
        conn.sendall(json.dumps(obj).encode() + b"\n")
    except OSError:
        pass  # the test side went away; the child is reaped all the same


def serve(path: str) -> None:
    """The launcher's main loop (single-threaded, so that forking is safe): preload, then serve requests."""
    for name in _PRELOAD:
        importlib.import_module(name)
    for name in _RUN_AS_MAIN:
        sys.modules.pop(name, None)
    base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    known_paths = {os.path.abspath(p) for p in sys.path[1:]}
    launcher_env = dict(os.environ)

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "reap")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "parent")  # EOF: the pytest worker is gone
    children: dict[int, tuple[socket.socket, bool]] = {}  # pid -> (connection, kill when it closes)
    sys.stdout.write("ready\n")
    sys.stdout.flush()

    while True:
        for key, _mask in sel.select():
            what = key.data
            if what == "parent":
                if not os.read(sys.stdin.fileno(), 4096):
                    return
            elif what == "reap":
                os.read(wake_r, 4096)
                _reap(children, sel)
            elif what == "accept":
                conn, _ = listener.accept()
                try:
                    request, fds = _recv_request(conn)
                except (OSError, EOFError, ValueError) as exc:
                    _send_line(conn, {"refused": repr(exc)})
                    conn.close()
                    continue
                differs = _import_time_differences(request["env"], launcher_env)
                differs += _new_paths(request, known_paths)
                if differs:  # the test side starts it the ordinary way
                    for fd in fds:
                        os.close(fd)
                    _send_line(conn, {"refused": f"differs from the launcher's: {', '.join(differs)}"})
                    conn.close()
                    continue
                ready_r, ready_w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(ready_r)
                    sel.close()
                    listener.close()
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.close(wake_r)
                    os.close(wake_w)
                    for other, _kill in children.values():
                        other.close()
                    _child(conn, request, fds, base_path, ready_w)  # never returns
                os.close(ready_w)
                for fd in fds:
                    os.close(fd)
                # As Popen returns only once the child has exec'd: the pid goes out once its session, streams,
                # directory and environment are set (a killpg(pid) right after must find its group).
                os.read(ready_r, 1)
                os.close(ready_r)
                _send_line(conn, {"pid": pid})
                children[pid] = (conn, bool(request.get("kill_on_eof")))
                sel.register(conn, selectors.EVENT_READ, pid)
                _reap(children, sel)  # a SIGCHLD that came while the request was read
            else:  # a test-side connection readable: only EOF is expected
                pid = what
                try:
                    data = key.fileobj.recv(1)  # type: ignore[union-attr]
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(key.fileobj)
                    if pid in children and children[pid][1]:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass


def _reap(children: dict[int, tuple[socket.socket, bool]], sel: selectors.BaseSelector) -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        entry = children.pop(pid, None)
        if entry is None:
            continue
        conn, _kill = entry
        _send_line(conn, {"status": status, "cpu_s": usage.ru_utime + usage.ru_stime})
        try:
            sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()


def _text_stream(fd: int, write: bool, encoding: str, errors: str, unbuffered: bool) -> io.TextIOWrapper:
    """A standard stream as the interpreter makes it: unbuffered (PYTHONUNBUFFERED, -u), a writer's text layer sits
    on the raw file with no buffered layer between (so no "reentrant call" check either); stdin is always
    buffered; stderr and terminals are line-buffered."""
    raw = io.FileIO(fd, "w" if write else "r", closefd=False)
    layer: Any = raw if write and unbuffered else io.BufferedWriter(raw) if write else io.BufferedReader(raw)
    line = write and (fd == 2 or os.isatty(fd))
    return io.TextIOWrapper(
        layer, encoding=encoding, errors=errors, newline="\n", line_buffering=line, write_through=unbuffered
    )


def _child(conn: socket.socket, request: dict[str, Any], fds: list[int], base_path: list[str], ready: int) -> None:
    """In the forked child: become the requested command, then exit as a fresh interpreter would."""
    code = 1
    try:
        _become(conn, request, fds, base_path, ready)
        code = _run(request)
    except BaseException:  # noqa: BLE001 - the child reports and exits, whatever happened
        try:
            traceback.print_exc()
        finally:
            os._exit(1)
    os._exit(code)


def _become(conn: socket.socket, request: dict[str, Any], fds: list[int], base_path: list[str], ready: int) -> None:
    """Set up the child as a fresh process of the request would be, then tell the launcher (`ready`)."""
    try:
        if request.get("setsid"):
            os.setsid()
        for target, fd in enumerate(fds):
            if fd != target:
                os.dup2(fd, target, inheritable=True)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        conn.close()
        env: dict[str, str] = request["env"]
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
        encoding, _, errors = env.get("PYTHONIOENCODING", "").partition(":")
        encoding = encoding or sys.__stdout__.encoding  # type: ignore[union-attr]
        unbuffered = bool(env.get("PYTHONUNBUFFERED"))
        streams = (
            _text_stream(0, False, encoding, errors or "strict", False),
            _text_stream(1, True, encoding, errors or "strict", unbuffered),
            _text_stream(2, True, encoding, "backslashreplace", unbuffered),
        )
        sys.stdin, sys.stdout, sys.stderr = streams
        setattr(sys, "__stdin__", streams[0])  # noqa: B010 - typeshed marks them final; a fresh process has them so
        setattr(sys, "__stdout__", streams[1])  # noqa: B010
        setattr(sys, "__stderr__", streams[2])  # noqa: B010
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if "module" in request:
            sys.path[:] = [os.getcwd(), *extra, *base_path]
        else:
            sys.path[:] = [str(Path(request["script"]).resolve().parent), *extra, *base_path]
        importlib.invalidate_caches()
    finally:
        os.close(ready)


def _run(request: dict[str, Any]) -> int:
    import runpy

    argv: list[str] = request["argv"]
    code = 0
    try:
        if "module" in request:
            sys.argv = ["-m", *argv]
            runpy._run_module_as_main(request["module"], alter_argv=True)  # type: ignore[attr-defined]
        else:
            sys.argv = [request["script"], *argv]
            module, _, attr = request["entry"].partition(":")
            sys.exit(getattr(importlib.import_module(module), attr)())
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - as the interpreter does: the traceback, then status 1
        traceback.print_exc()
        code = 1
    _finish()
    return code & 0xFF


def _finish() -> None:
    """What the interpreter does at exit: wait for non-daemon threads, run atexit handlers, flush."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


# -- the test side -------------------------------------------------------------------------------------------------

_ORIGINAL_POPEN: Any = subprocess.Popen  # Any: the subclass below overrides its private methods
_lock = threading.Lock()
# One launcher per value of OMP_NUM_THREADS (read when torch's OpenMP loads; the doc pages and some device tests set
# it to 1), started on first use: key -> (process, socket path), or None where it could not start.
_KEYED = "OMP_NUM_THREADS"
# CPU seconds of the commands this process had launched that have ended (theirs and their reaped children's, from
# wait4): the launcher reaps them, so this process's RUSAGE_CHILDREN does not hold them (bench/suite_profile.py adds
# this figure).
_launched_cpu = [0.0]
_refused: Counter[str] = Counter()  # why the launcher sent eligible commands the ordinary way, and how often
# The environment a launcher starts with: the worker's when `install` ran, not whatever a test has set when the first
# command comes (a variable a test sets for a while, read at import, would otherwise send every later command the
# ordinary way).
_BASE_ENV: dict[str, str] = dict(os.environ)
_launchers: dict[str | None, tuple[subprocess.Popen[bytes], str] | None] = {}


def socket_for(env: dict[str, str]) -> str | None:
    """The socket of the launcher that serves commands with this environment (started on first use), or None
    where none can run (then commands start the ordinary way)."""
    if os.environ.get(DISABLE) == "1":
        return None
    key = env.get(_KEYED)
    with _lock:
        running = _launchers.get(key, ())
        if running is None:
            return None
        if running and running[0].poll() is None:
            return running[1]
        folder = tempfile.mkdtemp(prefix="protofl-launcher-")
        path = os.path.join(folder, "s")
        root = str(Path(__file__).resolve().parents[1])
        launcher_env = {k: v for k, v in _BASE_ENV.items() if k != _KEYED}
        if key is not None:
            launcher_env[_KEYED] = key
        launcher_env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, _BASE_ENV.get("PYTHONPATH")]))
        proc = _ORIGINAL_POPEN(
            [sys.executable, "-c", "import sys, tests.launcher as launcher; launcher.serve(sys.argv[1])", path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=root,
            env=launcher_env,
        )
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            proc.kill()
            proc.wait()
            _launchers[key] = None
            return None
        if not _launchers:
            atexit.register(_stop)
        _launchers[key] = (proc, path)
        return path


def _stop() -> None:
    for running in _launchers.values():
        if running is None or running[0].poll() is not None:
            continue
        proc = running[0]
        assert proc.stdin is not None
        proc.stdin.close()  # the launcher exits on EOF
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _target(args: list[str], env: dict[str, str]) -> dict[str, str] | None:
    """The launcher's description of `args` (a module or a console script of this project), or None."""
    if len(args) >= 3 and args[1] == "-m" and os.path.abspath(args[0]) == os.path.abspath(sys.executable):
        if args[2].split(".")[0] in _PACKAGES:
            return {"module": args[2]}
        return None
    if not args:
        return None
    name = os.path.basename(args[0])
    if name not in _SCRIPTS:
        return None
    found = shutil.which(args[0], path=env.get("PATH", os.defpath)) if os.sep not in args[0] else args[0]
    ours = os.path.join(sys.prefix, "bin", name)
    if found is None or not os.path.exists(ours) or not os.path.samefile(found, ours):
        return None
    return {"script": found, "entry": _SCRIPTS[name]}


def _new_paths(request: dict[str, Any], known: set[str]) -> list[str]:
    """PYTHONPATH folders the launcher did not import from: what was imported there may differ (a module that hides
    torch, a plugin whose entry points the registry read at import), so such a command goes the ordinary way."""
    entries = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    new = [p for p in entries if os.path.abspath(os.path.join(request["cwd"], p)) not in known]
    return [f"PYTHONPATH {p}" for p in new]


def _import_time_differences(env: dict[str, str], launcher_env: dict[str, str]) -> list[str]:
    """The variables read at import time whose value in `env` is not the launcher's."""
    out = []
    for key in sorted(set(env) | set(launcher_env)):
        watched = key.startswith(_IMPORT_TIME) or (key.startswith("PYTHON") and key not in _PYTHON_HANDLED)
        if watched and env.get(key) != launcher_env.get(key):
            out.append(key)
    return out


class LaunchingPopen(_ORIGINAL_POPEN):
    """`subprocess.Popen` that forks this project's commands from the launcher (see the module's docstring); any
    other command, or one the launcher cannot reproduce, is started the ordinary way."""

    _conn: socket.socket | None = None
    _inbox = b""
    returncode: int | None

    def _execute_child(  # noqa: PLR0913 - subprocess.Popen's own signature
        self,
        args: Any,
        executable: Any,
        preexec_fn: Any,
        close_fds: bool,
        pass_fds: Any,
        cwd: Any,
        env: Any,
        startupinfo: Any,
        creationflags: Any,
        shell: bool,
        p2cread: int,
        p2cwrite: int,
        c2pread: int,
        c2pwrite: int,
        errread: int,
        errwrite: int,
        restore_signals: bool,
        gid: Any,
        gids: Any,
        uid: Any,
        umask: int,
        start_new_session: bool,
        process_group: Any,
    ) -> None:
        original = (
            args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags, shell,
            p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids, uid, umask,
            start_new_session, process_group,
        )  # fmt: skip
        if not self._launch(*original):
            super()._execute_child(*original)

    def _launch(self, *a: Any) -> bool:
        (args, executable, preexec_fn, _close_fds, pass_fds, cwd, env, _si, _cf, shell) = a[:10]
        (p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite) = a[10:16]
        (_restore, gid, gids, uid, umask, start_new_session, process_group) = a[16:]
        if os.environ.get(DISABLE) == "1" or shell or isinstance(args, (str, bytes, os.PathLike)):
            return False
        if preexec_fn is not None or pass_fds or gid is not None or gids is not None or uid is not None:
            return False
        if umask != -1 or process_group not in (None, -1):
            return False
        args = [os.fsdecode(x) for x in args]
        if executable is not None and os.fsdecode(executable) != args[0]:
            return False
        child_env = {os.fsdecode(k): os.fsdecode(v) for k, v in (os.environ if env is None else env).items()}
        target = _target(args, child_env)
        if target is None:
            return False
        workdir = os.path.abspath(os.fsdecode(cwd)) if cwd is not None else os.getcwd()
        if not os.path.isdir(workdir):
            return False  # the ordinary path raises the error Popen users expect
        path = socket_for(child_env)
        if path is None:
            return False
        request = {
            **target,
            "argv": args[3:] if "module" in target else args[1:],
            "env": child_env,
            "cwd": workdir,
            "setsid": bool(start_new_session),
        }
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            send_request(conn, request, fds)
            reply = self._read_line(conn, block=True)
        except OSError:
            conn.close()
            return False
        if reply is None or "pid" not in reply:  # refused: see _import_time_differences
            with _lock:
                _refused[str((reply or {}).get("refused", "no reply"))] += 1
            conn.close()
            return False
        self.pid = int(reply["pid"])
        self._conn = conn
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        return True

    def _read_line(self, conn: socket.socket, block: bool) -> dict[str, Any] | None:
        while b"\n" not in self._inbox:
            try:
                chunk = conn.recv(4096, 0 if block else socket.MSG_DONTWAIT)
            except BlockingIOError:
                return None
            except InterruptedError:
                continue
            if not chunk:
                raise ChildProcessError(errno.ECHILD, "the test launcher closed before reporting the process's status")
            self._inbox += chunk
        line, _, self._inbox = self._inbox.partition(b"\n")
        return dict(json.loads(line))

    def _status(self, block: bool) -> int | None:
        assert self._conn is not None
        reply = self._read_line(self._conn, block)
        if reply is None:
            return None
        self._conn.close()
        with _lock:
            _launched_cpu[0] += float(reply.get("cpu_s", 0.0))
        return int(reply["status"])

    def _internal_poll(self, _deadstate: int | None = None, **_kw: Any) -> int | None:
        if self._conn is None:
            return super()._internal_poll(_deadstate)
        if self.returncode is None:
            if not self._waitpid_lock.acquire(False):
                return None
            try:
                if self.returncode is None:
                    status = self._status(block=False)
                    if status is not None:
                        self._handle_exitstatus(status)
            except OSError:
                if _deadstate is not None:
                    self.returncode = _deadstate
            finally:
                self._waitpid_lock.release()
        return self.returncode

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        if self._conn is None:
            return super()._try_wait(wait_flags)
        status = self._status(block=not wait_flags & os.WNOHANG)
        return (0, 0) if status is None else (self.pid, status)


def launched_cpu_s() -> float:
    """CPU seconds of this process's launched commands that have ended and been waited for (see `_launched_cpu`)."""
    with _lock:
        return _launched_cpu[0]


def refused() -> dict[str, int]:
    """Why eligible commands of this process went the ordinary way, and how many (bench/suite_profile.py lists it)."""
    with _lock:
        return dict(_refused)


def install() -> None:
    """Make `subprocess.Popen` (and so `subprocess.run`) the launching one in this process."""
    _BASE_ENV.clear()
    _BASE_ENV.update(os.environ)
    if os.environ.get(DISABLE) != "1":
        subprocess.Popen = LaunchingPopen  # type: ignore[misc]
