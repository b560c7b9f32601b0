"""`KvspliceConnector`: vLLM's KV connector API (v1, vLLM 0.32) over the kvsplice sidecar.

Wiring only: the scheduler half (`scheduler_side`) and the worker half
(`worker_side`) do the work; this class maps vLLM's hooks onto them. Lookups run off
the scheduler loop; a load runs beside the engine's steps while other requests run
(`load_kv_async`: the request waits, the others keep running; `get_finished` says when),
else in the step before the forward pass (`load_async`); saves copy blocks out after the step and put them from a background
thread; the worker's news (acknowledged puts, load faults) reaches the
scheduler through vLLM's worker metadata. No hook lets a sidecar fault escape into
vLLM: each is a miss or a recompute, counted and logged once per kind.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvsplice.common.reuse_modes import ANCHOR
from kvsplice.integrations.vllm.anchor_loads import AnchorGate
from kvsplice.integrations.vllm.block_layout import UnsupportedLayout, check_supported, layout_for
from kvsplice.integrations.vllm.connector_config import ConnectorConfig
from kvsplice.integrations.vllm.connector_stats import (
    KvspliceConnectorStats,
    KvsplicePromMetrics,
    interval,
)
from kvsplice.integrations.vllm.engine_fingerprint import (
    ROPE_KEYS,
    effective_fingerprint,
    engine_fingerprint,
)
from kvsplice.integrations.vllm.request_keys import check_request_fields
from kvsplice.integrations.vllm.reuse_policy import admitted_engine_modes, mode_params
from kvsplice.integrations.vllm.scheduler_side import SchedulerSide
from kvsplice.integrations.vllm.sidecar_faults import FaultLog
from kvsplice.integrations.vllm.store_clients import StoreClients
from kvsplice.integrations.vllm.transfer_specs import (
    AnchorSpec,
    LoadSpec,
    RequestStart,
    SaveSpec,
    WorkerNews,
)
from kvsplice.integrations.vllm.worker_side import WorkerSide
from kvsplice.kvmath.rope import RopeSpec

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass
class KvspliceMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    starts: list[RequestStart] = field(default_factory=list)
    num_faults_seen: int = 0  # load faults the scheduler had absorbed when it planned this
    anchors: list[AnchorSpec] = field(default_factory=list)  # refused runs, now computed


@dataclass
class KvspliceWorkerMetadata(KVConnectorWorkerMetadata):
    news: WorkerNews = field(default_factory=WorkerNews)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvspliceWorkerMetadata)
        return KvspliceWorkerMetadata(self.news.merge(other.news))


class KvspliceConnector(KVConnectorBase_V1):
    """Exact-prefix KV shared through a kvsplice sidecar (`kv_role` "kv_both")."""

    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_like_vllm()
        transfer = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra_config(transfer.kv_connector_extra_config or {})
        _check_parallelism(vllm_config)
        self.layout_kind = _checked_layout(vllm_config)
        self.block_size = vllm_config.cache_config.block_size
        self.chunk_tokens = self.config.chunk_tokens_for(self.block_size)
        kv_dtype = _kv_dtype(vllm_config)
        self.fingerprint = served_fingerprint(vllm_config.model_config, kv_dtype)
        self.clients = StoreClients(self.config)
        self.faults = FaultLog()
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self._disabled: str | None = None
        self._disabled_reported = False
        self._load_errors: set[int] = set()
        self._finished_loads: set[str] = set()  # async loads a disabled worker could not run
        self._stats_seen: dict[str, int] = {}  # the totals at the last get_kv_connector_stats
        if role == KVConnectorRole.SCHEDULER:
            check_request_fields()
            engine_modes = admitted_engine_modes(self.config.reuse_policy, self.fingerprint)
            self.scheduler = SchedulerSide(
                self.clients, self.fingerprint, self.block_size, self.chunk_tokens,
                save_decode=self.config.save_decode_for(kv_dtype),
                load_async=self.config.load_async,
                save_tails=self.config.save_tails,
                lookup_wait_s=self.config.lookup_wait_ms / 1000,
                lookup_timeout_s=self.config.lookup_deadline_ms / 1000,
                faults=self.faults, engine_modes=engine_modes,
                hash_block_size=getattr(kv_cache_config, "hash_block_size", None),
            )  # fmt: skip
            _warn_if_failing_requests(transfer)
        if self.config.negative_control is not None:
            logger.warning(
                "kvsplice connector: NEGATIVE CONTROL %r: approximate runs are deliberately "
                "damaged (the graded yardstick's control; never serve with it)",
                self.config.negative_control,
            )
        logger.info(
            "kvsplice connector (%s) -> %s namespace %r, chunks of %d tokens, fingerprint %s",
            role.name, self.config.target, self.config.namespace, self.chunk_tokens, self.fingerprint,
        )  # fmt: skip

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    # ---- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()))
        try:
            kind = check_supported(self._vllm_config)  # the loaded layers' own backends
            layout = layout_for(first, self.block_size, kind, _cpu_isa(self._vllm_config, first))
            # the anchor gate as the policy calibrated it (a policy it cannot run: refused here)
            gate = AnchorGate.from_policy(
                *mode_params(self.config.reuse_policy, self.fingerprint, ANCHOR)
            )
            self.worker = WorkerSide(
                self.clients, self.fingerprint, self.block_size, kv_caches, layout,
                self.config.quant, self.config.max_pending_saves, self.faults,
                rope=lambda: RopeSpec.from_hf_config(self._vllm_config.model_config.hf_text_config),
                negative_control=self.config.negative_control, anchor_gate=gate,
            )  # fmt: skip
        except UnsupportedLayout as error:
            self._disabled = f"this worker cannot read its KV cache: {error}"
            logger.error("kvsplice connector disabled on this worker: %s", error)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvspliceMetadata)
        for spec in meta.loads:
            if self.worker is None:
                self._load_errors.update(spec.block_ids)
                if spec.is_async:
                    self._finished_loads.add(spec.request_id)
            elif spec.is_async:
                self.worker.async_loads.submit(spec)
            else:
                self._load_errors.update(self.worker.load(spec))  # never raises
        if self.worker is not None:
            for start in meta.starts:
                self.worker.report(start)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # every layer's blocks are copied out once, in wait_for_save

    def wait_for_save(self) -> None:
        if self.worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvspliceMetadata)
        for spec in meta.saves:
            self.worker.save(spec, meta.num_faults_seen)  # never raises
        for anchor in meta.anchors:
            self.worker.save_anchors(anchor)  # never raises

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(nothing sent, requests whose async loads ended); their blocks that could not be
        written go out in this same step's `get_block_ids_with_load_errors` (vLLM asks it
        right after), so a request never resumes over unwritten blocks."""
        finished, self._finished_loads = self._finished_loads, set()
        if self.worker is not None:
            done, failed = self.worker.async_loads.take_finished()
            finished |= done
            self._load_errors |= failed
        return None, finished or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        news = WorkerNews()
        if self.worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, KvspliceMetadata)
            news = self.worker.take_news(meta.num_faults_seen)
        if self._disabled and not self._disabled_reported:
            news.disabled, self._disabled_reported = self._disabled, True
        return KvspliceWorkerMetadata(news) if news else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.lookups.close()
        self.clients.close()

    # ---- stats (vLLM's logged KV transfer metrics and /metrics) ---------------------------

    def get_kv_connector_stats(self) -> KvspliceConnectorStats | None:
        """This half's counters since the last call (vLLM adds the halves and workers up)."""
        totals = self._stat_totals()
        stats = interval(totals, self._stats_seen)
        self._stats_seen = totals
        return None if stats.is_empty() else stats

    def _stat_totals(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        if self.scheduler is not None:
            side, breaker = self.scheduler, self.scheduler.lookups.breaker
            totals.update(
                lookups=side.num_lookups, failed_lookups=side.lookups.num_failed_lookups,
                promised_exact_tokens=side.num_promised_exact_tokens,
                promised_approximate_tokens=side.num_promised_approximate_tokens,
                breaker_trips=breaker.num_trips, breaker_open=int(breaker.is_open),
            )  # fmt: skip
        if self.worker is not None:
            w = self.worker
            totals.update(
                loaded_tokens=w.num_loaded_tokens, failed_loads=w.num_failed_loads,
                corrupt_loads=w.num_corrupt_loads, missing_loads=w.num_missing_loads,
                stored_chunks=w.num_stored_chunks, failed_saves=w.num_failed_saves,
                withheld_saves=w.num_withheld_saves,
            )  # fmt: skip
        return totals

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KvspliceConnectorStats | None:
        return KvspliceConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: VllmConfig, metric_types: dict[Any, Any], labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvsplicePromMetrics:  # fmt: skip
        return KvsplicePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- scheduler side ----------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        try:
            num_tokens = self.scheduler.num_new_matched_tokens(request, num_computed_tokens)
            return num_tokens, bool(num_tokens) and self.scheduler.is_async_load(request)
        except Exception as error:  # a bug must not stop the scheduler: no external hit
            self.faults.record("lookup failed", repr(error))
            return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        if num_external_tokens > 0:
            block_ids = blocks.get_block_ids()[0]
            self.scheduler.after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        loads, saves, starts = self.scheduler.build_step(scheduler_output)
        anchors = self.scheduler.take_anchors()
        return KvspliceMetadata(loads, saves, starts, self.scheduler.num_faults_seen, anchors)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KvspliceWorkerMetadata):
            self.scheduler.absorb(meta.news)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """`BlockStored` for the chunks the sidecar acknowledged since the last call
        (`kv_events`); vLLM publishes them beside its own with `--kv-events-config`."""
        return () if self.scheduler is None else self.scheduler.events.take()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = None
        if self.scheduler is not None:
            params = self.scheduler.finished(request)
        return False, params


def _log_like_vllm() -> None:
    """Send kvsplice's log records where vLLM's go (its handlers sit on the "vllm" logger)."""
    ours, theirs = logging.getLogger("kvsplice"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.level or logging.INFO)
        ours.propagate = False


def _check_parallelism(vllm_config: VllmConfig) -> None:
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ValueError(
            "KvspliceConnector supports tensor_parallel_size=1 and pipeline_parallel_size=1 "
            f"(got {parallel.tensor_parallel_size} and {parallel.pipeline_parallel_size})"
        )


def _checked_layout(vllm_config: VllmConfig) -> str:
    """The KV layout kind the engine uses; in both roles, a ValueError before any promise
    for a model or backend this connector cannot read (MLA, quantized KV, others)."""
    try:
        return check_supported(vllm_config)
    except UnsupportedLayout as error:
        raise ValueError(f"KvspliceConnector cannot serve this engine: {error}") from None


def served_fingerprint(model_config: ModelConfig, kv_dtype: str) -> str:
    """The fingerprint an engine's K/V is stored under (its model's files, the KV dtype and
    the settings that change K/V): what an admission policy for this engine must name."""
    files = engine_fingerprint(_model_dir(model_config), kv_dtype)
    return effective_fingerprint(files, _engine_settings(model_config))


def _model_dir(model_config: ModelConfig) -> Path:
    """The local directory of the served model (a hub id resolves in the local cache only)."""
    model = model_config.model
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download

    revision = model_config.revision
    return Path(snapshot_download(model, revision=revision, local_files_only=True))


def _engine_settings(model: ModelConfig) -> dict[str, Any]:
    """The engine's settings that change K/V beyond the model's files."""
    text = model.hf_text_config
    overrides = model.hf_overrides
    if callable(overrides):
        overrides = f"{overrides.__module__}.{overrides.__qualname__}"
    return {
        "quantization": model.quantization,
        "hf_overrides": overrides,
        "rope": {k: getattr(text, k) for k in ROPE_KEYS if getattr(text, k, None) is not None},
    }


def _kv_dtype(vllm_config: VllmConfig) -> str:
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", None):
        raise ValueError(
            f"KvspliceConnector stores unquantized KV only (cache_dtype {cache_dtype!r})"
        )
    return str(vllm_config.model_config.dtype).removeprefix("torch.")


def _cpu_isa(vllm_config: VllmConfig, cache: torch.Tensor) -> str | None:
    if cache.device.type != "cpu":
        return None
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    head_dim = cache.shape[-1] // 2
    return _get_attn_isa(cache.dtype, int(cache.shape[2]), head_dim, "auto")


def _warn_if_failing_requests(transfer: Any) -> None:
    """vLLM's policy is respected; its default, "fail", ends a request whose load faults."""
    if transfer.kv_load_failure_policy != "recompute":
        logger.warning(
            "kv_load_failure_policy is %r: a request whose KV load fails (a sidecar restart, "
            'an evicted or corrupt segment) ends with an error; set it to "recompute" '
            "to recompute such blocks instead",
            transfer.kv_load_failure_policy,
        )
