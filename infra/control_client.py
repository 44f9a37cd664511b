"""A typed client for the control-plane API (`clora.infra.control`), as the admin.

    client = ControlClient("http://127.0.0.1:8090", token)
    client.create_tenant("acme")["api_key"]
    client.delete_tenant("acme")

One method per route. A refusal raises a `ControlError` subclass carrying the error envelope
(`{"error": {code, message, field}}`, `clora.web`) and the HTTP status: `NotFound` (404),
`Unauthorized` (401), `Refused` (any other 4xx: a conflict, a field that failed validation),
`Unreachable` (no answer, or a 5xx). `local_control()` builds one for this machine's platform.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

DEFAULT_TIMEOUT_S = 30.0


class ControlError(Exception):
    """The control API refused a call or could not be reached. `status` is the HTTP status (None
    when nothing answered); `code`, `message` and `field` come from the error envelope."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None,
                 field: str | None = None):
        super().__init__(message)
        self.message, self.status, self.code, self.field = message, status, code, field


class NotFound(ControlError):
    """404: no such tenant, key, version or dead letter."""


class Unauthorized(ControlError):
    """401: the admin token is missing or wrong."""


class Refused(ControlError):
    """Another 4xx: a conflict (the tenant exists), or a value that failed validation (`field`)."""


class Unreachable(ControlError):
    """No answer from the control API, or a 5xx (retrying later may succeed)."""


class ControlClient:
    """The control API at `base_url` (`http://host:port`, without `/api`) with the admin token."""

    def __init__(self, base_url: str, token: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 transport: httpx.BaseTransport | None = None):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url + "/api", timeout=timeout_s, transport=transport,
                                  headers={"Authorization": f"Bearer {token}"})

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "ControlClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, path: str, *, json: Any = None, params: dict | None = None) -> dict:
        try:
            r = self._http.request(method, path, json=json, params=params)
        except httpx.HTTPError as e:
            raise Unreachable(f"cannot reach the control API at {self.base_url} ({e})") from e
        if r.status_code < 400:
            return r.json()
        try:
            error = r.json()["error"]
            code, message, field = error.get("code"), str(error.get("message")), error.get("field")
        except (ValueError, KeyError, TypeError, AttributeError):
            code, message, field = None, r.text[:500] or r.reason_phrase, None
        kind = {404: NotFound, 401: Unauthorized}.get(r.status_code)
        if kind is None:
            kind = Refused if r.status_code < 500 else Unreachable
        raise kind(message, status=r.status_code, code=code, field=field)

    # --- tenants ------------------------------------------------------------------------

    def list_tenants(self) -> dict:
        return self._call("GET", "/tenants")

    def create_tenant(self, tenant_id: str, *, name: str = "", policy: dict | None = None,
                      init_adapter: str | None = None, signing_secret: bool = False) -> dict:
        body: dict[str, Any] = {"id": tenant_id, "name": name, "signing_secret": signing_secret}
        if policy is not None:
            body["policy"] = policy
        if init_adapter is not None:
            body["init_adapter"] = init_adapter
        return self._call("POST", "/tenants", json=body)

    def get_tenant(self, tenant_id: str) -> dict:
        return self._call("GET", f"/tenants/{tenant_id}")

    def delete_tenant(self, tenant_id: str) -> dict:
        return self._call("DELETE", f"/tenants/{tenant_id}")

    def update_policy(self, tenant_id: str, changes: dict[str, Any]) -> dict:
        return self._call("PATCH", f"/tenants/{tenant_id}/policy", json=changes)

    def pause(self, tenant_id: str) -> dict:
        return self._call("POST", f"/tenants/{tenant_id}/pause")

    def resume(self, tenant_id: str) -> dict:
        return self._call("POST", f"/tenants/{tenant_id}/resume")

    # --- keys ---------------------------------------------------------------------------

    def create_key(self, tenant_id: str) -> dict:
        return self._call("POST", f"/tenants/{tenant_id}/keys")

    def rotate_key(self, tenant_id: str, key_id: str | None = None) -> dict:
        return self._call("POST", f"/tenants/{tenant_id}/keys/rotate",
                          params={"key_id": key_id} if key_id is not None else None)

    def revoke_key(self, tenant_id: str, key_id: str) -> dict:
        return self._call("DELETE", f"/tenants/{tenant_id}/keys/{key_id}")

    def create_tinker_key(self, tenant_id: str) -> dict:
        return self._call("POST", f"/tenants/{tenant_id}/tinker-keys")

    def list_tinker_keys(self, tenant_id: str) -> dict:
        return self._call("GET", f"/tenants/{tenant_id}/tinker-keys")

    def revoke_tinker_key(self, tenant_id: str, key_id: str) -> dict:
        return self._call("DELETE", f"/tenants/{tenant_id}/tinker-keys/{key_id}")

    # --- adapter versions ---------------------------------------------------------------

    def versions(self, tenant_id: str) -> dict:
        return self._call("GET", f"/tenants/{tenant_id}/versions")

    def freshness(self, tenant_id: str) -> dict:
        return self._call("GET", f"/tenants/{tenant_id}/freshness")

    def promote(self, tenant_id: str, version: int) -> dict:
        return self._call("POST", f"/tenants/{tenant_id}/versions/{version}/promote")

    def rollback(self, tenant_id: str, version: int | None = None) -> dict:
        return self._call("POST", f"/tenants/{tenant_id}/rollback", json={"version": version})

    # --- data ---------------------------------------------------------------------------

    def buffers(self, tenant_id: str, n: int = 10) -> dict:
        return self._call("GET", f"/tenants/{tenant_id}/buffers", params={"n": n})

    def feedback(self, tenant_id: str, n: int = 50) -> dict:
        return self._call("GET", f"/tenants/{tenant_id}/feedback", params={"n": n})

    def metrics(self, tenant_id: str, n: int = 500) -> dict:
        return self._call("GET", f"/tenants/{tenant_id}/metrics", params={"n": n})

    def traffic(self, tenant_id: str, minutes: int = 60) -> dict:
        return self._call("GET", f"/tenants/{tenant_id}/traffic", params={"minutes": minutes})

    def dead_letters(self, n: int = 100) -> dict:
        return self._call("GET", "/dlq", params={"n": n})

    def replay_dead_letter(self, event_id: str) -> dict:
        return self._call("POST", f"/dlq/{event_id}/replay")

    def platform_events(self, n: int = 50) -> dict:
        return self._call("GET", "/platform/events", params={"n": n})

    def engine(self) -> dict:
        return self._call("GET", "/engine")


def local_control(url: str | None = None, token: str | None = None) -> ControlClient:
    """A client for `url` with `token`, each defaulting to this machine's platform: the console's
    host and port (`ConsoleSettings`) and the admin token (`CLORA_ADMIN_TOKEN`, else
    `<data_dir>/admin_token`, `clora.infra.control.load_admin_token`)."""
    from clora.infra.settings import ConsoleSettings
    from clora.settings import PlatformSettings

    if url is None:
        s = ConsoleSettings()
        url = f"http://{s.host}:{s.port}"
    if token is None:
        platform = PlatformSettings()
        token = platform.admin_token or _read_token(platform.data_dir / "admin_token")
    return ControlClient(url, token)


def _read_token(path: Path) -> str:
    """The admin token `clora up` wrote; without it, an `Unauthorized` naming the file (a CLI
    must not create a token the running platform does not know)."""
    try:
        return path.read_text().strip()
    except OSError as e:
        raise Unauthorized(f"no admin token: {path} cannot be read ({e.strerror}); pass --token or set "
                           "CLORA_CONTROL_TOKEN", field="token") from e
