#!/usr/bin/env python3
"""The ZMQ event-plane broker for tests/dynamo/run.sh: an XSUB/XPUB forwarder on loopback.

  broker.py

Dynamo's ZMQ event plane binds its publishers to 0.0.0.0 in direct mode; in broker mode
(DYN_ZMQ_BROKER_URL='xsub=tcp://H:P1 , xpub=tcp://H:P2') publishers connect to the XSUB side and
subscribers to the XPUB side of a broker instead. This one binds both to free ports on 127.0.0.1,
prints `xsub=tcp://127.0.0.1:P1 , xpub=tcp://127.0.0.1:P2` once bound, and forwards until killed.
"""

import signal
import sys

import zmq


def main():
    ctx = zmq.Context()
    xsub = ctx.socket(zmq.XSUB)
    xpub = ctx.socket(zmq.XPUB)
    xsub_port = xsub.bind_to_random_port("tcp://127.0.0.1")
    xpub_port = xpub.bind_to_random_port("tcp://127.0.0.1")
    print(f"xsub=tcp://127.0.0.1:{xsub_port} , xpub=tcp://127.0.0.1:{xpub_port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        zmq.proxy(xsub, xpub)
    except (KeyboardInterrupt, SystemExit, zmq.ContextTerminated):
        pass


if __name__ == "__main__":
    main()
