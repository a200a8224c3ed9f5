"""``python -m ppo_core_monarch.serve --address tcp://HOST:PORT``: run a Monarch worker loop on this machine.

Start one on every machine of a cluster (or several on one machine to simulate hosts), then attach to them
with :func:`ppo_core_monarch.attach_hosts`. Once it listens it writes its address to ``--ready-file`` (if
given) and runs until the controller shuts the hosts down (or it is terminated). A loop that cannot listen (the port
is taken) exits with the error before writing the file: the loop fails at once rather than looking ready, so
:func:`ppo_core_monarch.start_worker_loops` retries it on another port.

Example:
    $ python -m ppo_core_monarch.serve --address tcp://$(hostname):$PORT
"""

from __future__ import annotations

import argparse
import os

import ppo_core_monarch  # noqa: F401  (sets Monarch's supervision environment before Monarch is imported)

__all__ = ["main"]

LISTEN_CHECK_S = 0.5
"""How long the loop waits for its listener to fail before it counts as listening (a taken port fails almost at once)."""


def main(argv: list[str] | None = None) -> None:
    """Parse ``--address`` and serve until shut down."""
    parser = argparse.ArgumentParser(
        prog="python -m ppo_core_monarch.serve", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--address", required=True, help="tcp://HOST:PORT to listen on (no wildcard host)")
    parser.add_argument("--ready-file", default=None, help="file to create with the address once listening")
    ns = parser.parse_args(argv)
    from monarch.actor import start_worker_loop_forever

    from ppo_core_monarch.launch import CA

    done = start_worker_loop_forever(ca=CA, address=ns.address)
    try:  # the loop listens in the background; a port already taken ends it within milliseconds
        done.get(timeout=LISTEN_CHECK_S)
    except TimeoutError:
        pass  # still running: listening
    else:
        raise SystemExit(f"the worker loop at {ns.address} ended before serving")
    if ns.ready_file:
        tmp = ns.ready_file + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(ns.address)
        os.replace(tmp, ns.ready_file)  # atomic: the launcher never reads a partial file
    done.get()


if __name__ == "__main__":
    main()
