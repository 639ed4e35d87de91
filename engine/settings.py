"""RunSettings: everything a user chooses for one run, as one object (the sampler settings travel whole as
SamplingParams). The app, the CLI, the debugger and trace files all build and store this same type."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .errors import InputError
from .sampling import SamplingParams

# Keys of older trace files, where the sampler settings were stored flat beside the prompt.
_SAMPLER_KEYS = tuple(f.name for f in dataclasses.fields(SamplingParams))


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    prompt: str
    chat: bool = True
    system: str | None = None
    allow_special: bool = False        # let special-token text typed in the prompt act as control tokens
    max_new_tokens: int = 32
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    timing: bool = True                # per-layer timing marks

    def __post_init__(self) -> None:
        if not isinstance(self.params, SamplingParams):
            raise InputError(f"params must be a SamplingParams, got {type(self.params).__name__}")

    def generation_kwargs(self) -> dict:
        """Keyword arguments of GenerationRun / Model.generate for these settings (all but the prompt)."""
        return dict(chat=self.chat, system=self.system, allow_special=self.allow_special,
                    max_new_tokens=self.max_new_tokens, params=self.params, seed=self.seed, stop=list(self.stop),
                    ignore_eos=self.ignore_eos)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["stop"] = list(self.stop)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RunSettings":
        """The inverse of as_dict; also reads older files whose sampler settings sit flat beside the prompt.
        Keys this version has no field for are ignored; a wrong type is an InputError naming the field."""
        if not isinstance(d, dict):
            raise InputError(f"run settings must be a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        params = kw.pop("params", None)
        if params is None:
            params = {k: d[k] for k in _SAMPLER_KEYS if k in d}
        if not isinstance(params, dict):
            raise InputError("run settings: params must be a JSON object")
        kw["params"] = SamplingParams(**{k: v for k, v in params.items() if k in _SAMPLER_KEYS})
        stop = kw.get("stop", ())
        if isinstance(stop, str) or not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise InputError("run settings: stop must be a list of strings")
        kw["stop"] = tuple(stop)
        try:
            return cls(**kw)
        except TypeError as e:
            raise InputError(f"run settings: {e}") from None
