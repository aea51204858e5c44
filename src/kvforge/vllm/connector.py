"""``KVForgeConnector``: vLLM's KV connector API (``KVConnectorBase_V1``) on a kvforge store. The one module that
imports vLLM.

Start vLLM with::

    python -m vllm.entrypoints.openai.api_server --model MODEL_FOLDER --kv-transfer-config \\
      '{"kv_connector": "KVForgeConnector", "kv_connector_module_path": "kvforge.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"store": "file:///var/cache/kv"}}'

Scheduler side (:class:`kvforge.vllm.plan.TransferPlanner`): a new request's prompt is looked up block by block
in the store; the blocks found are loaded before its first step, and each whole prompt block is saved once the
step that completes it has run. Worker side: loads are read from the store, checked (checksums by the store;
model fingerprint, tokens, shape here) and written into vLLM's paged blocks; saves are copied out of the paged
blocks after each layer and written by a background thread. The element layout of a paged block is learnt from
the attention backend's own writer (:mod:`kvforge.vllm.layout`), never assumed. A block that cannot be loaded is
reported to vLLM, which recomputes it (``kv_load_failure_policy: recompute``); it is never used.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvforge.errors import UserError
from kvforge.reuse.prefix import PrefixReuse
from kvforge.store import open_store
from kvforge.vllm import documents as docs
from kvforge.vllm.blocks import BlockWriter, block_segment, check_block
from kvforge.vllm.identity import ServedModel, announce
from kvforge.vllm.layout import BlockLayout, LayoutError, probe_layout
from kvforge.vllm.plan import BlockMove, DocumentMove, StepMoves, TransferPlanner
from kvforge.vllm.settings import ConnectorSettings, check_vllm_version

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass
class KVForgeMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step: the blocks to load before the forward and to save after it."""

    moves: StepMoves = field(default_factory=StepMoves)


@dataclass(frozen=True)
class _ModelSpec:
    layer_index: dict[str, int]  # vLLM attention layer name -> decoder layer index
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int


def _model_spec(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> _ModelSpec:
    """What the blocks look like, refusing what this connector cannot store exactly."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise UserError("the kvforge connector runs on one GPU/CPU worker: tensor and pipeline parallel size 1")
    if vllm_config.cache_config.cache_dtype not in ("auto", None):
        raise UserError(f"the kvforge connector stores the model's own KV dtype; got --kv-cache-dtype "
                        f"{vllm_config.cache_config.cache_dtype!r} (use auto)")  # fmt: skip
    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec if len(groups) == 1 else None
    if not isinstance(spec, FullAttentionSpec) or getattr(spec, "sliding_window", None) is not None:
        raise UserError(
            "the kvforge connector stores models whose layers all use full attention (one KV cache group, no "
            "sliding window, no MLA or state-space layers); this model has "
            + ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
        )
    if spec.head_size_v not in (None, spec.head_size):
        raise UserError("the kvforge connector needs keys and values of one head size")
    names = list(groups[0].layer_names)
    layer_index = {name: extract_layer_index(name) for name in names}
    if sorted(layer_index.values()) != list(range(len(names))):
        raise UserError(f"cannot map vLLM's attention layers to decoder layers 0..{len(names) - 1}: {names[:3]}...")
    return _ModelSpec(layer_index, spec.num_kv_heads, spec.head_size, spec.dtype, spec.block_size)


def _model_id(vllm_config: VllmConfig, settings: ConnectorSettings) -> str:
    """kvforge's fingerprint of the served model, computed from its files as :func:`kvforge.model.load_model` would."""
    if settings.model_id:
        return settings.model_id
    from kvforge.model import folder_fingerprint

    model_config = vllm_config.model_config
    folder = Path(model_config.model)
    if not folder.is_dir():  # a hub id: the snapshot vLLM downloaded
        from huggingface_hub import snapshot_download

        try:
            folder = Path(snapshot_download(model_config.model, revision=model_config.revision, local_files_only=True))
        except Exception as e:
            raise UserError(
                f"the kvforge connector keys stored KV by the model's files; {model_config.model!r} is not a local "
                f"folder nor a downloaded hub model ({e}); serve a folder or set kv_connector_extra_config.model_id"
            ) from None
    dtype = str(model_config.dtype).removeprefix("torch.")
    tokenizer = None
    if model_config.tokenizer and Path(model_config.tokenizer) != Path(model_config.model):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer)
    return folder_fingerprint(folder, dtype, tokenizer=tokenizer)


def _share_vllm_logging() -> None:
    """Show kvforge's messages (hits, store warnings) in vLLM's log, formatted as vLLM's own."""
    ours, theirs = logging.getLogger("kvforge"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


class KVForgeConnector(KVConnectorBase_V1):
    """vLLM KV connector saving prompt KV blocks into a kvforge store and loading them for later requests.

    Options (``kv_connector_extra_config``): ``store`` (URL), ``block_size`` (tokens per stored block, default 256),
    ``quant`` (int8/int4/int2 storage), ``model_id`` (fingerprint override); see
    :class:`kvforge.vllm.settings.ConnectorSettings`.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        import vllm

        check_vllm_version(vllm.__version__)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _share_vllm_logging()
        self._warned: dict[str, float] = {}
        self._disabled: str | None = None  # why saving/loading stopped (a backend whose blocks cannot be addressed)
        self.settings = ConnectorSettings.parse(self._kv_transfer_config.kv_connector_extra_config)
        self.spec = _model_spec(vllm_config, kv_cache_config)
        self.model_id = _model_id(vllm_config, self.settings)
        self.store = open_store(self.settings.store)
        prefix = PrefixReuse(self.store, self.model_id, block_size=self.settings.block_size)
        if role == KVConnectorRole.SCHEDULER:
            self.planner = TransferPlanner(
                prefix.block_chains,
                prefix.root,
                self._contains,
                block_size=vllm_config.cache_config.block_size,
                store_block_size=self.settings.block_size,
                load=self._kv_transfer_config.is_kv_consumer,
                save=self._kv_transfer_config.is_kv_producer,
            )
            if self.planner.save:  # the router reads what the blocks are keyed by from the store
                served = ServedModel(vllm_config.model_config.model, self.model_id, self.settings.block_size,
                                     vllm_config.cache_config.block_size)
                try:
                    announce(self.store, served)
                except Exception as e:  # a read-only store: blocks still load, routers cannot find this model
                    logger.warning("kvforge connector: cannot announce the model in the store (%s)", e)
            logger.info("kvforge connector: %s, model %s", self.settings.describe(), self.model_id)
        else:
            self.writer = BlockWriter(self.store, quant=self.settings.quant, prefix=prefix)
            self._layouts: dict[tuple[Any, ...], BlockLayout] = {}
            self._saving: dict[str, tuple[BlockMove, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}
            self._load_errors: set[int] = set()
            self._layers = vllm_config.compilation_config.static_forward_context
            self._hf_config = vllm_config.model_config.hf_config
            self._rope: Any = None  # the model's RoPE, to move a document's keys to their slots
            self._warm_up()

    def _warm_up(self) -> None:
        """Read at start what the first document load would otherwise read: the model's RoPE and the KV basis the
        store codes this model with (kvtc), so a first question costs no more than the next ones."""
        from kvforge.rope import rope_spec_from_config
        from kvforge.store.transform import store_basis

        try:
            self._rope = rope_spec_from_config(self._hf_config)
        except Exception as e:  # no RoPE that moves: documents are refused when asked, with this reason
            logger.debug("kvforge connector: no RoPE for documents (%s)", e)
        try:
            store_basis(self.store, self.model_id)
        except Exception as e:  # an unreachable store: read again at the first load
            logger.debug("kvforge connector: KV basis not read at start (%s)", e)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # blocks are copied out after each attention layer: CUDA graphs must leave those calls to Python

    # ================================================================================== scheduler side
    # A store fault must never take vLLM down: every store call of the scheduler side is a miss when it fails.
    def _contains(self, key: str) -> bool:
        try:
            return bool(self.store.contains(key))
        except Exception as e:
            self._warn_once("store lookup failed (%s); treated as a miss", e)
            return False

    def _warn_once(self, message: str, *args: Any, every_s: float = 60.0) -> None:
        now = time.monotonic()
        if now - self._warned.get(message, -every_s) >= every_s:
            self._warned[message] = now
            logger.warning("kvforge connector: " + message, *args)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        try:
            doc = docs.ServedDocument.from_params(getattr(request, "kv_transfer_params", None))
            if doc is not None:
                return self._match_document(request, doc, num_computed_tokens), False
            return self.planner.matched_tokens(request.prompt_token_ids or [], num_computed_tokens), False
        except Exception as e:
            self._warn_once("lookup failed (%s); treated as a miss", e)
            return 0, False

    def _match_document(self, request: Request, doc: docs.ServedDocument, num_computed: int) -> int:
        """Slots of stored document ``doc`` to load for ``request``; 0 (and the outcome reported as not loaded) when
        the prompt does not start with the document's placeholder or the store no longer describes it."""
        prompt = request.prompt_token_ids or []
        reason = None
        if len(prompt) <= doc.num_slots or prompt[: doc.num_slots] != doc.placeholder_ids():
            reason = "the prompt does not start with the document's placeholder"
        elif docs.find(self.store, doc.key) != doc:
            reason = "the document is not stored (or was stored again since)"
        if reason is not None:
            self._warn_once("request names document %s but %s; it is not loaded", doc.key[:24], reason)
            self.planner.document_failed.add(request.request_id)
            return 0
        return self.planner.match_document(request.request_id, doc, num_computed)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Report, in the response's ``kv_transfer_params``, whether a named document was served from its KV."""
        try:
            doc = docs.ServedDocument.from_params(getattr(request, "kv_transfer_params", None))
        except docs.DocumentError:
            doc = None
        if doc is None:
            return False, None
        failed = request.request_id in self.planner.document_failed
        if failed:  # its placeholder may now be cached with other KV: never send it again
            docs.withdraw(self.store, doc.key)
        return False, {docs.PARAM: {"key": doc.key, "loaded": not failed, "slots": doc.num_slots}}

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.planner.allocated(request.request_id, num_external_tokens)
        if num_external_tokens > 0:
            logger.info(
                "kvforge connector: request %s loads %d of its %d prompt tokens from the store",
                request.request_id, num_external_tokens, len(request.prompt_token_ids or []),
            )  # fmt: skip

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        try:
            return KVForgeMetadata(self._plan_step(scheduler_output))
        except Exception as e:  # never take the engine down: nothing moves this step, promised loads are recomputed
            self._warn_once("planning a step failed (%s); nothing loaded or saved in it", e)
            moves = StepMoves()
            for new in scheduler_output.scheduled_new_reqs:
                moves.failed += self.planner.abandon(new.req_id, new.block_ids[0], new.num_computed_tokens)
            self.planner.finish(scheduler_output.finished_req_ids)
            return KVForgeMetadata(moves)

    def _plan_step(self, scheduler_output: SchedulerOutput) -> StepMoves:
        moves = StepMoves()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self.planner.start(
                new.req_id, new.prompt_token_ids, new.block_ids[0], new.num_computed_tokens, scheduled[new.req_id],
                moves,
            )  # fmt: skip
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            blocks = None if new_ids is None else new_ids[0]
            if req_id in cached.resumed_req_ids:  # after a preemption every block is new
                self.planner.resume(req_id, blocks or [], cached.num_computed_tokens[i], scheduled[req_id], moves)
            else:
                self.planner.advance(req_id, blocks, cached.num_computed_tokens[i], scheduled[req_id], moves)
        self.planner.finish(scheduler_output.finished_req_ids)
        return moves

    def update_connector_output(self, connector_output: Any) -> None:
        failed = getattr(connector_output, "invalid_block_ids", None)
        if failed:
            self.planner.failed(set(failed))

    # ================================================================================== worker side
    def _kernel_blocks(self, cache: torch.Tensor, block_ids: list[int]) -> tuple[int, list[int]]:
        """(tokens per block of ``cache``, its blocks holding the scheduler's ``block_ids``): a backend may split each
        scheduler block into several kernel blocks."""
        ratio = max(cache.shape[0] // self._kv_cache_config.num_blocks, 1)
        if ratio == 1:
            return self.spec.block_size, block_ids
        return self.spec.block_size // ratio, [b * ratio + j for b in block_ids for j in range(ratio)]

    def _layout(self, layer_name: str, cache: torch.Tensor) -> BlockLayout:
        """The block layout of ``layer_name``'s cache, probed once per backend, block shape and dtype."""
        layer = self._layers[layer_name]
        impl = getattr(layer, "impl", None)
        key = (type(impl), tuple(cache.shape[1:]), cache.dtype, cache.device, getattr(layer, "isa", None))
        layout = self._layouts.get(key)
        if layout is None:
            write = getattr(impl, "do_kv_cache_update", None)
            if write is None:
                raise LayoutError(f"attention backend {type(impl).__name__} has no separate KV cache writer")
            layout = probe_layout(
                lambda k, v, scratch, slots: write(layer, k, v, scratch, slots),
                cache.shape[1:], self._kernel_blocks(cache, [])[0], self.spec.num_kv_heads, self.spec.head_size,
                cache.dtype, cache.device,
            )  # fmt: skip
            self._layouts[key] = layout
        return layout

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVForgeMetadata)
        self._load_errors.update(meta.moves.failed)
        if not meta.moves.loads and not meta.moves.documents:
            return
        caches = {name: layer.kv_cache for name, layer in forward_context.no_compile_layers.items()
                  if name in self.spec.layer_index}  # fmt: skip
        for doc_move in meta.moves.documents:
            self._load_document(doc_move, caches)
        for move in reversed(meta.moves.loads):  # the last block read first: prefixes stay the most recently used
            segment = None if self._disabled else self._read(move)
            try:
                if segment is None:
                    raise LookupError
                lo, hi = move.first - move.start, move.last - move.start
                for name, cache in caches.items():
                    layer = self.spec.layer_index[name]
                    keys, values = segment.keys[layer][:, lo:hi], segment.values[layer][:, lo:hi]
                    blocks = self._kernel_blocks(cache, move.block_ids)[1]
                    self._layout(name, cache).scatter(cache, blocks, keys, values)
            except LookupError:
                self._load_errors.update(move.block_ids)  # vLLM recomputes from the first failed block
            except LayoutError as e:
                self._disable(e)
                self._load_errors.update(move.block_ids)

    def _load_document(self, move: DocumentMove, caches: dict[str, torch.Tensor]) -> None:
        """Write slots ``[first, last)`` of a stored document into the request's blocks (keys rotated by ``k - n``);
        a document that cannot be read or checked is reported failed (vLLM recomputes the blocks)."""
        doc, spec = move.doc, self.spec
        try:
            if self._disabled:
                raise LookupError(self._disabled)
            segment = self.store.get(doc.key)
            if segment is None:
                raise LookupError("missing or corrupt in the store")
            reason = docs.check_document(segment, doc, self.model_id, len(spec.layer_index), spec.num_kv_heads,
                                         spec.head_size)  # fmt: skip
            if reason is not None:
                raise LookupError(reason)
            if self._rope is None:
                from kvforge.rope import rope_spec_from_config

                self._rope = rope_spec_from_config(self._hf_config)
            keys, values = docs.slot_kv(segment, doc, self._rope, spec.dtype)
            for name, cache in caches.items():
                layer = spec.layer_index[name]
                blocks = self._kernel_blocks(cache, move.block_ids)[1]
                lo = move.first - move.first % spec.block_size  # the block of slot ``first`` is written whole
                size = len(move.block_ids) * spec.block_size
                if move.last - lo == size:  # whole blocks of slots: written as they are
                    k, v = keys[layer][:, lo : move.last], values[layer][:, lo : move.last]
                else:
                    k = keys[layer].new_zeros(spec.num_kv_heads, size, spec.head_size)
                    v = values[layer].new_zeros(spec.num_kv_heads, size, spec.head_size)
                    k[:, : move.last - lo] = keys[layer][:, lo : move.last]
                    v[:, : move.last - lo] = values[layer][:, lo : move.last]
                self._layout(name, cache).scatter(cache, blocks, k, v)
        except (LookupError, LayoutError, docs.DocumentError) as e:
            logger.warning("kvforge connector: document %s not loaded (%s); its request is recomputed",
                           doc.key[:24], e)  # fmt: skip
            self._load_errors.update(move.block_ids)
        except Exception as e:  # a store that went away
            logger.warning("kvforge connector: document %s unreadable (%s)", doc.key[:24], e)
            self._load_errors.update(move.block_ids)

    def _read(self, move: BlockMove) -> Any:
        try:
            segment = self.store.get(move.key)  # checksums checked: a corrupt entry is a miss, removed
        except Exception as e:  # a store that went away: recompute
            logger.warning("kvforge connector: block %s unreadable (%s); recomputed", move.key[:24], e)
            return None
        if segment is None:
            logger.warning("kvforge connector: block %s is missing or corrupt in the store; recomputed",
                           move.key[:24])  # fmt: skip
            return None
        spec = self.spec
        reason = check_block(segment, move, self.model_id, len(spec.layer_index), spec.num_kv_heads, spec.head_size)
        if reason is not None:  # removed, as PrefixReuse removes it, so the recomputed block can be stored
            logger.warning("kvforge connector: block %s %s; recomputed, and removed", move.key[:24], reason)
            try:
                self.store.delete(move.key)
            except Exception as e:
                logger.debug("kvforge connector: block %s not removed (%s)", move.key[:24], e)
            return None
        return segment

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVForgeMetadata)
        layer = self.spec.layer_index.get(layer_name)
        if not meta.moves.saves or layer is None or self._disabled:
            return
        try:
            layout = self._layout(layer_name, kv_layer)
        except LayoutError as e:
            self._disable(e)
            return
        for move in meta.moves.saves:
            keys, values = layout.gather(kv_layer, self._kernel_blocks(kv_layer, move.block_ids)[1])
            self._saving.setdefault(move.key, (move, {}))[1][layer] = (keys, values)

    def _disable(self, error: Exception) -> None:
        if self._disabled is None:
            self._disabled = str(error)
            logger.error("kvforge connector: cannot address this backend's KV blocks (%s); nothing is stored or "
                         "loaded by this server", error)  # fmt: skip
        self._saving.clear()

    def wait_for_save(self) -> None:
        num_layers = len(self.spec.layer_index)
        blocks = []
        for key, (move, layers) in self._saving.items():
            if len(layers) != num_layers:
                logger.warning("kvforge connector: block %s saw %d of %d layers; not stored", key[:24], len(layers),
                               num_layers)  # fmt: skip
                continue
            ordered = [layers[i] for i in range(num_layers)]
            blocks.append((move, block_segment(move, [k for k, _ in ordered], [v for _, v in ordered], self.model_id)))
        self._saving.clear()
        self.writer.put(blocks)  # written head first, touched last to first, as PrefixReuse records

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._load_errors = self._load_errors, set()
        return failed

    def shutdown(self) -> None:
        writer = getattr(self, "writer", None)
        if writer is not None:
            writer.flush()
            writer.close()
            logger.info("kvforge connector: shut down; %d blocks written, %d failed", writer.num_written,
                        writer.num_failed)  # fmt: skip
        close = getattr(self.store, "close", None)
        if close is not None:
            close()
