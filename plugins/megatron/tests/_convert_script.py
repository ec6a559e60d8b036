"""``convert_and_publish`` in its own process, for the publish tests.

Usage: python _convert_script.py HF_DIR CACHE TP [HOLD_SIGNAL_FILE]

Prints one JSON line {"path": ..., "elapsed_s": ...}. With HOLD_SIGNAL_FILE the
publish is wrapped so that, as soon as the conversion has written its first
tensor file (``*.distcp``: megatron-core's writer
processes are running) into the staging directory, the signal file is created (holding the
staging path), and once the conversion is done the writer sleeps instead of
returning: the test SIGKILLs this process while the artifact is half-made.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from rlcore.publish import publish_dir
from rlcore_megatron.checkpoint import convert_and_publish
from rlcore_megatron.options import MegatronOptions


def holding_publish(signal_file: Path):
    def publish(destination: Path, write):
        def slow_write(staging: Path) -> None:
            def watch() -> None:
                while not any(f.name.endswith(".distcp") for f in staging.iterdir()):
                    time.sleep(0.002)
                signal_file.write_text(str(staging))

            threading.Thread(target=watch, daemon=True).start()
            write(staging)
            time.sleep(600)

        return publish_dir(destination, slow_write)

    return publish


def main() -> None:
    hf_dir, cache, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    publish = holding_publish(Path(sys.argv[4])) if len(sys.argv) > 4 else None
    t0 = time.monotonic()
    path = convert_and_publish(
        hf_dir, cache, MegatronOptions(tensor_model_parallel_size=tp), publish=publish
    )
    print(json.dumps({"path": str(path), "elapsed_s": time.monotonic() - t0}), flush=True)


if __name__ == "__main__":
    main()
