"""What a data-parallel run reports when replicas die or cannot build their engines."""

from __future__ import annotations

from dataclasses import dataclass

from batchllm.connectors.replicas.messages import BuildFailed


@dataclass(slots=True)
class ReplicaFailure:
    replica: int
    pid: int | None
    exitcode: int | None  # negative: killed by that signal
    requeued_rows: int  # rows it held unfinished, re-run by the other replicas
    error: str | None = None  # its traceback, when it could send one before exiting

    def describe(self) -> str:
        status = f"was killed by signal {-self.exitcode}" if self.exitcode and self.exitcode < 0 else \
            f"exited with status {self.exitcode}"
        text = (f"data-parallel replica {self.replica} (pid {self.pid}) {status}; its {self.requeued_rows} unfinished "
                f"rows are re-run by the other replicas")
        return text + (f"\n{self.error}" if self.error else "")


class ReplicaPoolError(RuntimeError):
    """Every replica died: nothing is left to run the remaining rows."""

    def __init__(self, message: str, failures: list[ReplicaFailure]) -> None:
        super().__init__(message)
        self.failures = failures


def build_error(message: BuildFailed) -> BaseException:
    text = f"data-parallel replica {message.replica} could not build its engine:\n{message.traceback}"
    error = message.error
    if error is None:
        return ReplicaPoolError(text, [])
    if hasattr(error, "add_note"):
        error.add_note(text)
    return error
