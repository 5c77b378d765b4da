"""The settings of the router's request path (router.service.frontend)."""

from __future__ import annotations

from dataclasses import dataclass, field

from edge.limits import RequestLimits
from router.core.admission import AdmissionConfig
from router.service.quota import QuotaConfig
from router.service.resilience import EjectionConfig
from router.service.tenancy import TenancyConfig

DEFAULT_MODEL_NAME = "kvroute-tiny"


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    """Admission, deadline, retry and tenancy settings of the router's request path."""

    max_inflight: int = 1024
    max_deadline_s: float = 600.0
    max_attempts: int = 2
    limits: RequestLimits = field(default_factory=RequestLimits)
    tenancy: TenancyConfig = field(default_factory=TenancyConfig)
    ejection: EjectionConfig = field(default_factory=EjectionConfig)
    model_name: str = DEFAULT_MODEL_NAME  # the default pool's name (router.core.pools)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    quotas: QuotaConfig = field(default_factory=QuotaConfig)  # per-tenant limits (quota.py)
    # tokenize only the head of a text prompt that a cache may match; the worker tokenizes
    # the rest (exact: the chunk cache's cut rule); False: the router tokenizes it all
    split_prompts: bool = True

    def __post_init__(self) -> None:
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")
        if not self.max_deadline_s > 0:
            raise ValueError(f"max_deadline_s must be > 0, got {self.max_deadline_s}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
