"""A host-side client for `make compose-check`: puts and reads segments through the port
docker compose publishes, with the project's own StoreClient (gRPC only, no same-host path).

  compose_client.py put    --target 127.0.0.1:50051 --num-segments 8   -> puts, reads back
  compose_client.py verify --target 127.0.0.1:50051 --num-segments 8   -> reads back only
Both exit 1 unless every segment comes back with the bytes that were put, and the chain's
prefix lookup finds all of it. The segments are a seeded chain: `verify` after a restart
checks the very bytes `put` stored before it.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass

from kvsplice.common.keys import root_key
from kvsplice.common.segment import SegmentMeta, chained_meta
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.config import StoreClientConfig
from kvsplice.storeclient.wire import with_payload_digest

FINGERPRINT = "kvfp1-" + "c0" * 16
NUM_TOKENS = 16
NUM_LAYERS = 30


@dataclass(frozen=True)
class Segment:
    meta: SegmentMeta
    payload: bytes


def make_chain(namespace: str, num_segments: int, payload_nbytes: int) -> list[Segment]:
    """Consecutive segments from position 0, tokens and payloads seeded by their index."""
    chain, parent = [], root_key(FINGERPRINT)
    for i in range(num_segments):
        rng = random.Random(i)
        token_ids = [rng.randrange(32_000) for _ in range(NUM_TOKENS)]
        payload = rng.randbytes(payload_nbytes)
        meta = chained_meta(namespace, FINGERPRINT, parent, token_ids, i * NUM_TOKENS, NUM_LAYERS)
        chain.append(Segment(with_payload_digest(meta, payload), payload))
        parent = meta.context_key
    return chain


def put_all(client: StoreClient, chain: list[Segment]) -> None:
    for segment in chain:
        if not client.put_segment(segment.meta, segment.payload):
            sys.exit(f"compose-client: put of segment {segment.meta.segment_id} failed")


def verify_all(client: StoreClient, chain: list[Segment]) -> None:
    for segment in chain:
        found = client.get_segment(segment.meta.context_key, model_fingerprint=FINGERPRINT)
        if found is None:
            sys.exit(f"compose-client: segment {segment.meta.segment_id} is missing")
        if bytes(found[1]) != segment.payload:
            sys.exit(f"compose-client: segment {segment.meta.segment_id} came back changed")
    token_ids = [t for segment in chain for t in segment.meta.token_ids]
    lookup = client.lookup_prefix(FINGERPRINT, token_ids)
    if lookup.num_matched_tokens != len(token_ids):
        sys.exit(
            f"compose-client: prefix lookup matched {lookup.num_matched_tokens}/{len(token_ids)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["put", "verify"])
    parser.add_argument("--target", required=True)
    parser.add_argument("--namespace", default="compose-check")
    parser.add_argument("--num-segments", type=int, default=8)
    parser.add_argument("--payload-kib", type=int, default=256)
    args = parser.parse_args()
    chain = make_chain(args.namespace, args.num_segments, args.payload_kib << 10)
    # The sidecar runs in a container: reads and puts must cross the published port.
    config = StoreClientConfig(same_host_reads=False, staged_puts=False)
    with StoreClient(args.target, args.namespace, config=config) as client:
        if args.action == "put":
            put_all(client, chain)
        verify_all(client, chain)
    total_kib = args.num_segments * args.payload_kib
    print(
        f"compose-client: {args.action}: {args.num_segments} segments ({total_kib} KiB) read "
        f"back through {args.target} with the bytes put; prefix lookup covers the chain"
    )


if __name__ == "__main__":
    main()
