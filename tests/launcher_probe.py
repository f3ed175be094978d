"""Run by tests/test_launcher.py as `python -m tests.launcher_probe EXIT_CODE`: says what its process looks like."""

import json
import os
import signal
import sys
import threading

if __name__ == "__main__":
    if sys.argv[1] == "wait":  # until a signal ends it; a non-daemon thread that must be waited for at exit first
        # SIGINT raises KeyboardInterrupt even where this process was started with it ignored (a background job)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print("waiting", flush=True)
        threading.Event().wait()
    done = threading.Event()
    threading.Thread(target=lambda: (done.wait(0.2), print("thread done", file=sys.stderr))).start()
    print(
        json.dumps(
            {
                "pid": os.getpid(),
                "ppid": os.getppid(),
                "cwd": os.getcwd(),
                "argv": sys.argv,
                "path0": sys.path[0],
                "probe": os.environ.get("PROBE"),
                "stdin": sys.stdin.read(),
                "torch": "torch" in sys.modules,
                "extra_path": os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] in sys.path,
            }
        )
    )
    sys.exit(int(sys.argv[1]))
