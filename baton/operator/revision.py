"""The `baton.dev/revision` label of engine pods: a short hash of the spec fields that decide
whether a prefill engine's KV blocks mean the same thing to a decode engine, equal for both pools
of one spec. It tells people and `kubectl -l` selectors which pods of a rollout belong together
and shows in the status; the router pairs engines by the fingerprint the engines report
themselves, never by this label.
"""

from __future__ import annotations

import hashlib
import json

from baton.operator.spec import InferenceServiceSpec

REVISION_LABEL = "baton.dev/revision"
REVISION_LENGTH = 10  # hex digits: 40 bits, no collision among a service's few revisions


def revision(spec: InferenceServiceSpec) -> str:
    """The revision label value of `spec`'s engine pods.

    What is hashed, and why each one changes what a KV block means:
    - `model.uri`: other weights (an `hf://` revision after `@` included). A `pvc://` or
      `file://` path whose files are replaced in place keeps its label; the engines'
      fingerprint still tells the two apart.
    - `image`: a new image can carry another KV wire version, kernels or cache layout.
    - `engine.dtype`, `engine.blockSize`, the tensor-parallel size: the bytes in a block, the
      tokens per block, and which KV heads each rank holds.
    - `kvTransfer.transport` (disaggregated only: an aggregated pool moves no KV, and a field
      that does not reach its pods must not roll them): TCP and NIXL do not talk to each other.
    - `engine.extraArgs`: the only way to pass `--tokenizer` and other engine flags that change
      the fingerprint; the operator cannot tell which of them do, so it counts them all.
    Everything else (replicas, autoscaling, names, lease and drain times, scheduling limits,
    router, resources) is left out: those change no block, and every field hashed here also
    changes the pod template, so the label never rolls pods that would not roll anyway.
    """
    tensor_parallel = sorted({pool.tensor_parallel_size for pool in spec.pools})
    fields = {
        "model": spec.model.uri,
        "image": spec.image,
        "dtype": spec.engine.dtype,
        "block_size": spec.engine.block_size,
        "tensor_parallel_size": tensor_parallel,
        "kv_transport": spec.kv_transfer.transport if spec.mode == "disaggregated" else None,
        "extra_args": list(spec.engine.extra_args),
    }
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:REVISION_LENGTH]
