"""RunSettings: everything a user chooses for one run, as one object (the sampler settings travel whole as
SamplingParams). The app, the CLI, the debugger and trace files all build and store this same type."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.errors import InputError
from engine.sampling import SamplingParams

# Stop strings are scanned against the text after every decoded token: a bound on them bounds that work.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 200

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
        object.__setattr__(self, "stop", check_stop(self.stop))

    def generation_kwargs(self) -> dict:
        """Keyword arguments of GenerationRun / engine.generate.generate for these settings (all but the prompt)."""
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
        if isinstance(stop, str):
            raise InputError("run settings: stop must be a list of strings")
        kw["stop"] = check_stop(stop)
        try:
            return cls(**kw)
        except TypeError as e:
            raise InputError(f"run settings: {e}") from None


def check_stop(stop) -> tuple[str, ...]:
    """Stop strings as a tuple, or an InputError naming what is wrong: at most MAX_STOP_STRINGS strings of at
    most MAX_STOP_CHARS characters each (a string alone is one stop string)."""
    if isinstance(stop, str):
        stop = [stop]
    if stop is None:
        return ()
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise InputError("stop must be a list of strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise InputError(f"{len(stop):,} stop strings given; at most {MAX_STOP_STRINGS} are accepted")
    long = next((s for s in stop if len(s) > MAX_STOP_CHARS), None)
    if long is not None:
        raise InputError(f"a stop string is {len(long):,} characters long; at most {MAX_STOP_CHARS} are accepted")
    return tuple(stop)
