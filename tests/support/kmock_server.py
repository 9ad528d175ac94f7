"""An emulated Kubernetes API server for the operator and discovery tests: kmock's emulator with
the API-server behaviour that kopf, the operator and the router's discovery rely on.

Plain kmock stores objects as JSON and serves discovery, but sets no uid, resourceVersion,
generation or timestamps, has no status subresource, PUT, label selectors or owner-reference
garbage collection, answers a failed JSON-patch `test` with 500, and its watch can lose events
between its snapshot and its subscription. This subclass keeps kmock's discovery, request parsing
and HTTP server and replaces its object handling with an event log: every change gets the next
resourceVersion and is appended to the log, so a watch from any resourceVersion replays exactly
what it missed. Server-side apply (`application/apply-patch+yaml`) merges and tracks field owners
as `server_side_apply.py` describes; with a `token`, every request must carry it as a bearer
token or gets 401. `ApiServer` runs it on 127.0.0.1 in a background thread for synchronous tests.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import secrets
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
import yaml
from kmock._internal import rendering  # the parsed request type; kmock exports no public alias

from tests.support import server_side_apply

Key = tuple[str, str, str, str | None, str]  # group, version, plural, namespace, name

# (group, version, plural) -> kind, namespaced, subresources
BUILTIN_RESOURCES: dict[tuple[str, str, str], tuple[str, bool, tuple[str, ...]]] = {
    ("", "v1", "namespaces"): ("Namespace", False, ("status",)),
    ("", "v1", "events"): ("Event", True, ()),
    ("", "v1", "services"): ("Service", True, ("status",)),
    ("", "v1", "serviceaccounts"): ("ServiceAccount", True, ()),
    ("", "v1", "secrets"): ("Secret", True, ()),
    ("", "v1", "pods"): ("Pod", True, ("status",)),
    ("events.k8s.io", "v1", "events"): ("Event", True, ()),
    ("apps", "v1", "deployments"): ("Deployment", True, ("status", "scale")),
    ("autoscaling", "v2", "horizontalpodautoscalers"): (
        "HorizontalPodAutoscaler",
        True,
        ("status",),
    ),
    ("policy", "v1", "poddisruptionbudgets"): ("PodDisruptionBudget", True, ("status",)),
    ("rbac.authorization.k8s.io", "v1", "roles"): ("Role", True, ()),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"): ("RoleBinding", True, ()),
    ("rbac.authorization.k8s.io", "v1", "clusterroles"): ("ClusterRole", False, ()),
    ("rbac.authorization.k8s.io", "v1", "clusterrolebindings"): ("ClusterRoleBinding", False, ()),
    ("discovery.k8s.io", "v1", "endpointslices"): ("EndpointSlice", True, ()),
    ("networking.k8s.io", "v1", "networkpolicies"): ("NetworkPolicy", True, ()),
    ("apiextensions.k8s.io", "v1", "customresourcedefinitions"): (
        "CustomResourceDefinition",
        False,
        ("status",),
    ),
}
VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]
APPLY_PATCH = "application/apply-patch+yaml"


class ApiError(Exception):
    """An answer in Kubernetes' `Status` form."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def matches_selector(labels: dict[str, str], selector: str) -> bool:
    """Equality- and existence-based label selectors: `a=b,c!=d,e,!f`."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


class ApiServerEmulator(kmock.KubernetesEmulator):  # type: ignore[misc]
    """The object store and watch log behind the emulated API server."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.store: dict[Key, dict[str, Any]] = {}
        self.log: list[tuple[int, tuple[str, str, str], dict[str, Any]]] = []
        self.kinds: dict[tuple[str, str, str], tuple[str, bool, tuple[str, ...]]] = {}
        self.revision = 0
        self.changed = asyncio.Condition()
        self.fail_next = 0  # answer this many more resource requests with 500 (fault injection)
        self.created: dict[Key, float] = {}  # time.monotonic() of each creation, for benchmarks
        self.uids: set[str] = set()  # of stored objects, for the garbage collector
        self.token: str | None = None  # when set, the only bearer token accepted
        self.refused = 0  # requests answered 401
        for (group, version, plural), info in BUILTIN_RESOURCES.items():
            self.declare(group, version, plural, *info)

    def declare(
        self,
        group: str,
        version: str,
        plural: str,
        kind: str,
        namespaced: bool,
        subs: tuple[str, ...],
    ) -> None:
        """Serves a resource (kopf finds custom resources through discovery)."""
        self.kinds[(group, version, plural)] = (kind, namespaced, subs)
        self.resources[kmock.resource(group, version, plural)] = kmock.ResourceInfo(
            kind=kind, namespaced=namespaced, verbs=VERBS, subresources=subs
        )

    # -- request dispatch ------------------------------------------------------------------------

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if self.token is not None and request.headers.get("Authorization") != (
            f"Bearer {self.token}"
        ):
            self.refused += 1
            return _status(ApiError(401, "Unauthorized", "Unauthorized"))
        res = request.resource
        if res is None or not res.plural or (res.group, res.version, res.plural) not in self.kinds:
            return await super()._handle(request)
        rkey = (res.group, res.version, res.plural)
        try:
            if self.fail_next > 0:
                self.fail_next -= 1
                raise ApiError(500, "InternalError", "injected failure")
            # kmock knows only `watch=true`; the API server reads any Go boolean (`watch=True`).
            if request.method.value == "GET" and _true(request.params.get("watch")):
                return await self._watch(request, rkey)
            method = request.method.value
            if method == "GET" and request.name is None:
                return _json(self._list(request, rkey))
            if method == "GET":
                return _json(self._fetch(rkey, request.namespace, request.name))
            async with self.changed:
                if method == "POST":
                    return _json(self._create(rkey, request.namespace, request.data), 201)
                key = (*rkey, request.namespace, request.name or "")
                if _content_type(request) == APPLY_PATCH and key not in self.store:
                    created = self._create(rkey, request.namespace, self._applied(request, None))
                    return _json(created, 201)
                if method in ("PATCH", "PUT"):
                    return _json(self._update(request, rkey))
                if method == "DELETE":
                    return _json(self._delete(rkey, request.namespace, request.name))
            raise ApiError(405, "MethodNotAllowed", f"{method} is not served")
        except ApiError as e:
            return _status(e)

    # -- reads -----------------------------------------------------------------------------------

    def _fetch(self, rkey: tuple[str, str, str], ns: str | None, name: str | None) -> dict:
        obj = self.store.get((*rkey, ns, name or ""))
        if obj is None:
            raise ApiError(404, "NotFound", f"{rkey[2]} {name!r} not found")
        return obj

    def _matching(self, rkey: tuple[str, str, str], obj: dict, request: rendering.Request) -> bool:
        meta = obj["metadata"]
        if request.namespace is not None and meta.get("namespace") != request.namespace:
            return False
        if request.name is not None and meta["name"] != request.name:
            return False
        selector = request.params.get("labelSelector", "")
        return matches_selector(meta.get("labels") or {}, selector)

    def _list(self, request: rendering.Request, rkey: tuple[str, str, str]) -> dict:
        items = [
            o for k, o in self.store.items() if k[:3] == rkey and self._matching(rkey, o, request)
        ]
        return {
            "apiVersion": f"{rkey[0]}/{rkey[1]}".lstrip("/"),
            "kind": f"{self.kinds[rkey][0]}List",
            "metadata": {"resourceVersion": str(self.revision)},
            "items": items,
        }

    async def _watch(
        self, request: rendering.Request, rkey: tuple[str, str, str]
    ) -> aiohttp.web.StreamResponse:
        raw_request = request._raw_request
        assert raw_request is not None
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw_request)
        since = request.params.get("resourceVersion", "")
        timeout = float(request.params.get("timeoutSeconds", "0")) or None
        async with self.changed:
            if since in ("", "0"):
                cursor = len(self.log)
                initial = [o for k, o in self.store.items() if k[:3] == rkey]
                pending = [{"type": "ADDED", "object": o} for o in initial]
            else:
                cursor = next(
                    (i for i, e in enumerate(self.log) if e[0] > int(since)), len(self.log)
                )
                pending = []
        try:
            async with asyncio.timeout(timeout):
                while True:
                    for event in pending:
                        if self._matching(rkey, event["object"], request):
                            await response.write(json.dumps(event).encode() + b"\n")
                    async with self.changed:
                        while cursor >= len(self.log):
                            await self.changed.wait()
                        fresh = self.log[cursor:]
                        cursor = len(self.log)
                    pending = [event for _, k, event in fresh if k == rkey]
        except (TimeoutError, ConnectionResetError):
            pass
        return response

    # -- writes (called under self.changed) ------------------------------------------------------

    def _emit(self, rkey: tuple[str, str, str], kind: str, obj: dict) -> None:
        self.log.append((self.revision, rkey, {"type": kind, "object": copy.deepcopy(obj)}))
        self.changed.notify_all()

    def _stamp(self, obj: dict) -> None:
        self.revision += 1
        obj["metadata"]["resourceVersion"] = str(self.revision)

    def _create(self, rkey: tuple[str, str, str], ns: str | None, body: Any) -> dict:
        if not isinstance(body, dict) or not isinstance(body.get("metadata"), dict):
            raise ApiError(400, "BadRequest", "the body must be an object with metadata")
        obj = copy.deepcopy(body)
        meta = obj["metadata"]
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)
        if not meta.get("name"):
            raise ApiError(422, "Invalid", "metadata.name is required")
        if self.kinds[rkey][1]:
            meta["namespace"] = ns or meta.get("namespace") or "default"
        key = (*rkey, meta.get("namespace"), meta["name"])
        if key in self.store:
            raise ApiError(409, "AlreadyExists", f"{rkey[2]} {meta['name']!r} already exists")
        if "status" in self.kinds[rkey][2]:
            obj.pop("status", None)  # set only through the status subresource
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=now)
        self._stamp(obj)
        self.store[key] = obj
        self.uids.add(meta["uid"])
        self.created[key] = time.monotonic()
        self._emit(rkey, "ADDED", obj)
        owners = [ref.get("uid") for ref in meta.get("ownerReferences") or []]
        if owners and not any(uid in self.uids for uid in owners):
            self._remove(key)  # the garbage collector deletes what only absent owners own
        return obj

    def _update(self, request: rendering.Request, rkey: tuple[str, str, str]) -> dict:
        key = (*rkey, request.namespace, request.name or "")
        old = self._fetch(rkey, request.namespace, request.name)
        content_type = _content_type(request)
        body = request.data
        try:
            if content_type == APPLY_PATCH:
                new = self._applied(request, old)
            elif request.method.value == "PUT":
                new = copy.deepcopy(body)
            elif content_type == "application/json-patch+json":
                new = jsonpatch.apply_patch(old, body, in_place=False)
            elif content_type in (
                "application/merge-patch+json",
                "application/strategic-merge-patch+json",
            ):
                new = _merge(old, body)
            else:
                raise ApiError(415, "UnsupportedMediaType", f"patch type {content_type!r}")
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
            raise ApiError(422, "Invalid", f"the patch does not apply: {e}") from e
        asked_version = (
            (body.get("metadata") or {}).get("resourceVersion") if isinstance(body, dict) else None
        )
        if asked_version and asked_version != old["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", "the object has been modified; reload and try again")
        if request.subresource == "status":
            new = copy.deepcopy(old) | {"status": new.get("status")}
        elif "status" in self.kinds[rkey][2]:
            new = {k: v for k, v in new.items() if k != "status"} | (
                {"status": old["status"]} if "status" in old else {}
            )
        for field in ("uid", "creationTimestamp", "namespace", "name", "resourceVersion"):
            if field in old["metadata"]:
                new.setdefault("metadata", {})[field] = old["metadata"][field]
        if new == old:
            return old  # a no-op write changes nothing and sends no event, as on a real server
        if _spec_of(new) != _spec_of(old):
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        self._stamp(new)
        self.store[key] = new
        meta = new["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            return self._remove(key)
        self._emit(rkey, "MODIFIED", new)
        return new

    def _applied(self, request: rendering.Request, live: dict | None) -> dict:
        """The object after the request's server-side apply to `live`."""
        body = request.data if request.data is not None else yaml.safe_load(request.text or "")
        manager = request.params.get("fieldManager")
        if not manager:
            raise ApiError(422, "Invalid", "fieldManager is required for apply patches")
        if not isinstance(body, dict) or (body.get("metadata") or {}).get("name") != request.name:
            raise ApiError(400, "BadRequest", "the applied object must name the object patched")
        try:
            force = _true(request.params.get("force"))
            return server_side_apply.apply(live, body, manager, force)
        except server_side_apply.Conflict as e:
            raise ApiError(409, "Conflict", str(e)) from e

    def _delete(self, rkey: tuple[str, str, str], ns: str | None, name: str | None) -> dict:
        obj = self._fetch(rkey, ns, name)
        key = (*rkey, ns, name or "")
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                obj = copy.deepcopy(obj)
                now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                obj["metadata"]["deletionTimestamp"] = now
                self._stamp(obj)
                self.store[key] = obj
                self._emit(rkey, "MODIFIED", obj)
            return obj
        return self._remove(key)

    def _remove(self, key: Key) -> dict:
        """Deletes an object and, like the garbage collector, everything it owns."""
        obj = self.store.pop(key)
        self.uids.discard(obj["metadata"]["uid"])
        self._stamp(obj)
        self._emit(key[:3], "DELETED", obj)
        uid = obj["metadata"]["uid"]
        for child_key, child in list(self.store.items()):
            owners = child["metadata"].get("ownerReferences") or []
            if child_key in self.store and any(o.get("uid") == uid for o in owners):
                self._delete(child_key[:3], child_key[3], child_key[4])
        return obj


def _spec_of(obj: dict) -> dict:
    """What bumps `metadata.generation`: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge(result.get(key), value)
    return result


def _json(payload: dict, status: int = 200) -> aiohttp.web.Response:
    return aiohttp.web.json_response(payload, status=status)


def _status(error: ApiError) -> aiohttp.web.Response:
    return _json(
        {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": error.code}
        | {"reason": error.reason, "message": error.message},
        error.code,
    )


def _true(value: str | None) -> bool:
    """A query parameter as Go's strconv.ParseBool reads it."""
    return value in ("1", "t", "T", "true", "TRUE", "True")


def _content_type(request: rendering.Request) -> str:
    return str(request.headers.get("Content-Type", "")).split(";")[0].strip()


class ApiServer:
    """The emulator served on a free 127.0.0.1 port from a background thread."""

    def __init__(self, token: str | None = None) -> None:
        self.handler = ApiServerEmulator()
        self.handler.token = token
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._serve, name="kmock", daemon=True)
        self.url = ""

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        async with self.handler, kmock.Server(self.handler) as server:
            self.url = f"http://127.0.0.1:{server.port}"
            self._ready.set()
            await self._stop.wait()

    def start(self) -> ApiServer:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the emulated API server did not start")
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def declare(self, *args: Any) -> None:
        """`ApiServerEmulator.declare`, from the test's thread."""
        self.loop.call_soon_threadsafe(self.handler.declare, *args)

    @property
    def token(self) -> str | None:
        return self.handler.token

    def headers(self) -> dict[str, str]:
        """What a test's own HTTP client sends to be let in."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def write_kubeconfig(
        self, path: Path, namespace: str = "default", user: dict[str, Any] | None = None
    ) -> Path:
        """A kubeconfig file that points at this server, as `user` (default: the server's token,
        or a dummy one)."""
        user = user if user is not None else {"token": self.token or "test-token"}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": user}],
            "contexts": [
                {
                    "name": "kmock",
                    "context": {"cluster": "kmock", "user": "kmock", "namespace": namespace},
                }
            ],
            "current-context": "kmock",
        }
        path.write_text(json.dumps(config))
        return path

    def objects(self, plural: str, namespace: str | None = None) -> Iterator[dict[str, Any]]:
        """A snapshot of the stored objects of one resource (for assertions)."""
        for key, obj in list(self.handler.store.items()):
            if key[2] == plural and (namespace is None or key[3] == namespace):
                yield obj


def endpoint_slice(service: dict[str, Any], ready: dict[str, bool], port: int = 8000) -> dict:
    """The EndpointSlice Kubernetes' controller would make for `service` with pods at the
    addresses in `ready` (address -> ready): the Service's labels plus its name."""
    meta = service["metadata"]
    labels = dict(meta.get("labels") or {})
    labels["kubernetes.io/service-name"] = meta["name"]
    labels["endpointslice.kubernetes.io/managed-by"] = "endpointslice-controller.k8s.io"
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{meta['name']}-x1",
            "namespace": meta["namespace"],
            "labels": labels,
        },
        "addressType": "IPv4",
        "ports": [
            {"name": "http", "port": port, "protocol": "TCP"},
            {"name": "kv", "port": 14579, "protocol": "TCP"},
        ],
        "endpoints": [
            {"addresses": [address], "conditions": {"ready": ok}} for address, ok in ready.items()
        ],
    }
