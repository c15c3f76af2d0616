"""Where the trainer's weight group (--update-weight-transport distributed) listens: it was 127.0.0.1 unless
SLIME_LITE_WEIGHT_MASTER_ADDR said otherwise, so engines on another node (each listens on its node's IP in a
multi-node cluster) dialled their own loopback and the first push timed out."""

from __future__ import annotations

import socket

from slime_lite.weight_transport import group_address


def test_engines_on_the_loopback_meet_there_and_others_at_this_hosts_address_on_the_route():
    assert group_address(["http://127.0.0.1:30000", "http://localhost:30001", "http://[::1]:30002"]) == "127.0.0.1"
    # an engine elsewhere: this host's address on the route to it (no packet sent), never a wildcard
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.7", 30000))
        want = s.getsockname()[0]
    assert group_address(["http://127.0.0.1:30000", "http://192.0.2.7:30000"]) == want
    assert want not in ("0.0.0.0", "127.0.0.1")
