"""Every exception the package defines derives from the one exported base, ``TrlMoeReplayError``, and still from the
built-in error it was before (so ``except ValueError`` and the like keep catching it)."""

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import trl_moe_replay
from trl_moe_replay.errors import TrlMoeReplayError


ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trl_moe_replay"

# The built-in base each exception had before the common base came (a subclass of another of ours inherits it).
BUILTIN_BASE = {
    "RolloutWorkerDiedError": RuntimeError,
    "AuditMemoryError": ValueError,
    "ScoreThresholdError": ValueError,
    "JSONFileError": ValueError,
    "CheckpointError": ValueError,
    "DistributedCheckpointError": ValueError,
    "CheckpointWeightsError": ValueError,
    "NoCheckpointError": FileNotFoundError,
    "ModelWeightsError": ValueError,
    "PlanError": ValueError,
    "RunFileRefusedError": OSError,
    "MatplotlibMissingError": ImportError,
    "RoutesUnavailableError": RuntimeError,
    "VLLMServerUnavailableError": RuntimeError,
    "ServerModeDependencyError": ImportError,
    "EngineSyncError": RuntimeError,
    "WeightSyncNotDeliveredError": RuntimeError,
    "EngineWeightsChangedError": RuntimeError,
    "EngineProbeNotFiniteError": RuntimeError,
    "SyncCheckUnavailableError": ValueError,
    "ToolTimeoutError": TimeoutError,
    "WeightSyncDirError": ValueError,
    "ParallelSizesError": ValueError,
    "ShardedAtLoadUnsupportedError": ValueError,
    "UnsupportedModelError": ValueError,
    "TransformersTooOldError": ValueError,
    "RouteValidationError": ValueError,
    "RouteAlignmentError": ValueError,
    "ConfigTypeError": (TypeError, ValueError),
    "ConfigValueError": ValueError,
    "UpstreamValueError": ValueError,
    "UnrecordableGenerationError": ValueError,
    "UnprovenEngineSetupError": ValueError,
    "LaunchMismatchError": RuntimeError,
    "ModelPathError": FileNotFoundError,
    "HubModelError": FileNotFoundError,
    "OutputDirInUseError": RuntimeError,
    "UnfaithfulPeftReplayError": ValueError,
    "PR2CheckpointError": ValueError,
    "PR2StateError": RuntimeError,
    "StaleRouteRowsError": ValueError,
    "UpstreamChangedError": RuntimeError,
    "TransformersChangedError": RuntimeError,
    "_ProbeStop": Exception,
}


#: Modules loaded on their own as well (no package around them), which therefore import nothing of the package: their
#: exception classes are private and caught inside them. extras/math/rewards.py is the reward helper process's code.
STANDALONE = {"trl_moe_replay.extras.math.rewards": {"_WorkerUnavailable"}}


def test_the_reward_helper_process_loads_rewards_py_standalone():
    """rewards.py runs, by its file path alone, as the helper process that bounds math-verify off the main thread: a
    package import in it kills the helper, and a hostile completion then runs unbounded (a relative import did)."""
    import subprocess
    import sys

    from trl_moe_replay.extras.math import rewards

    boot = rewards._WORKER_BOOT.replace("module._worker_main()\n", "print('loaded')\n")
    result = subprocess.run(
        [sys.executable, "-c", boot, rewards.__file__], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "loaded", result.stderr[-2000:]


def defined_exceptions() -> dict[str, type]:
    """Every exception class defined at the top level of a module of the package, by ``module.Name``."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__main__.py":  # runs the command on import
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        module = importlib.import_module(name)
        for attribute, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == name:
                found[f"{name}.{attribute}"] = value
    return found


@pytest.fixture(scope="module")
def exceptions() -> dict[str, type]:
    return defined_exceptions()


def test_every_exception_derives_from_the_base_and_keeps_its_builtin_base(exceptions):
    assert len(exceptions) >= 40
    ours = {
        qualified: cls
        for qualified, cls in exceptions.items()
        if cls is not TrlMoeReplayError and cls.__name__ not in STANDALONE.get(cls.__module__, ())
    }
    without_base = [name for name, cls in ours.items() if not issubclass(cls, TrlMoeReplayError)]
    assert not without_base, f"derive these from trl_moe_replay.errors.TrlMoeReplayError: {without_base}"
    unlisted = sorted({cls.__name__ for cls in ours.values()} - set(BUILTIN_BASE))
    assert not unlisted, f"a new exception class: add it and its built-in base to BUILTIN_BASE: {unlisted}"
    for name, cls in ours.items():
        assert issubclass(cls, BUILTIN_BASE[cls.__name__]), f"{name} no longer derives from its built-in base"


def test_the_base_is_exported_and_catches_the_exported_errors():
    assert "TrlMoeReplayError" in trl_moe_replay.__all__
    assert trl_moe_replay.TrlMoeReplayError is TrlMoeReplayError
    assert TrlMoeReplayError.__bases__ == (Exception,)
    exported = [getattr(trl_moe_replay, name) for name in trl_moe_replay.__all__]
    errors = [value for value in exported if inspect.isclass(value) and issubclass(value, BaseException)]
    assert len(errors) >= 9
    for error in errors:
        with pytest.raises(TrlMoeReplayError):
            raise error("one line")


def test_a_builtin_based_error_is_still_caught_and_built_as_before():
    from trl_moe_replay.checkpointing.checkpoints import NoCheckpointError
    from trl_moe_replay.core.config_checks import ConfigTypeError
    from trl_moe_replay.routing.errors import RouteValidationError

    with pytest.raises(ValueError, match="bad routes"):
        raise RouteValidationError("bad routes")
    with pytest.raises(TypeError):
        raise ConfigTypeError("a str, got an int")
    # OSError's constructor still fills errno, strerror and filename (the base sits before it in the MRO, adds none).
    missing = NoCheckpointError(2, "no checkpoint", "/tmp/run")
    assert (missing.errno, missing.strerror, missing.filename) == (2, "no checkpoint", "/tmp/run")
    assert isinstance(missing, FileNotFoundError) and isinstance(missing, TrlMoeReplayError)


def test_the_vllm_plugin_defines_no_exception_class():
    """The plugin imports nothing of ``trl_moe_replay`` (it runs inside vLLM's processes), so it cannot share the
    base; this test says so while it defines none."""
    plugin = ROOT / "trl_moe_replay_vllm_plugin"
    classes = [
        node
        for path in plugin.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    ]
    bases = [ast.unparse(base) for node in classes for base in node.bases]
    assert not [base for base in bases if base.endswith(("Error", "Exception"))], bases
