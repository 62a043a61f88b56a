"""A node's session records on its own disk: ``ledger-dir/sessions/<run>/``, one file per record.

A ClientApp runs per message (Flower 1.42), so each message's ClientApp rebuilds the session from what
the node saved when it answered the message before (deploy/client.py ``LocalState``).  Flower's
``context.state`` could carry it, but Flower stores a ClientApp's context when that process exits,
after its reply left, and keeps whichever context arrives last
(flwr/supernode/runtime/run_clientapp.py, ``push_task_output``): on a loaded host the next message's
ClientApp may start from the state before the last answer, and a ClientApp that started from an
older state may store it over the newer one.  Here each record is written, whole, before the reply
is sent (a temporary file renamed into place), and one message is answered at a time
(:meth:`NodeStateFiles.exclusive`), so every ClientApp reads the node's last answer.

A record holds what a session needs between messages, its secrets included (the session's seed, the
check's key), in 0600 files of a 0700 directory.  A session's seed is dropped from its record when the
session ends or fails (deploy/client.py), the check's key and values when the check ends: verified,
refused, or the classifier stored unverified (deploy/verify.py ``forget_check``); what an unfinished
step left (a session the coordinator abandoned, a classifier never delivered) stays until the node's
next run starts, which deletes the run's records.
Nothing here is unpickled: the fields are typed JSON, the arrays ``np.load(allow_pickle=False)``.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConfigurationError
from .tls import write_with_mode

STATE_DIR = "sessions"  # in the node's ledger-dir
FORMAT = "secure-afl-node-state/1"
_RUN = re.compile(r"[0-9]{1,20}")  # Flower's run id, an unsigned 64-bit integer
_UNREADABLE = (OSError, ValueError, KeyError, TypeError, AttributeError, EOFError, zipfile.BadZipFile)


class NodeStateFiles:
    """The records of one Flower run (:class:`~secure_afl.deploy.client.LocalState`): ``load`` and
    ``save`` by label (a label is the coordinator's text: the file is named by its SHA-256)."""

    def __init__(self, ledger_dir: Path, run: object) -> None:
        run_id = str(run)
        if not _RUN.fullmatch(run_id):
            raise ConfigurationError(f"Flower's run id {run_id[:40]!r} is not a number")
        self.ledger_dir = Path(ledger_dir)
        root = self.ledger_dir / STATE_DIR
        self.directory = root / run_id
        self._held: dict[str, dict[str, Any]] | None = None  # while exclusive(): the records read or written
        # Forget other runs' records: a finished or abandoned run keeps nothing here.
        for other in sorted(root.iterdir()) if root.is_dir() else ():
            if other.name != run_id and other.is_dir() and not other.is_symlink():
                shutil.rmtree(other)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Held while one message is answered: a second ClientApp of this node (a re-sent copy, a
        message the coordinator sent at the same time) waits, then reads the records the first wrote,
        instead of writing its own older ones over them.  The OS releases it if the process dies."""
        self._make_directory()
        handle = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
            # Nobody else writes while it is held: a record read again (handle reads a message's
            # record up to three times) comes from memory, not from a 33 MB file at d = 2048.
            self._held = {}
            yield
        finally:
            self._held = None
            os.close(handle)

    def _make_directory(self) -> None:
        for directory in (self.ledger_dir, self.directory.parent, self.directory):
            directory.mkdir(exist_ok=True, mode=0o700)  # a ledger-dir is 0700 (FileLedger's)

    def _hold(self, label: str, record: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``record`` to return, ``record`` kept while exclusive() is held; its arrays
        read-only, shared by every copy (a caller that changed one in place would change them all)."""
        if self._held is None:
            return record
        for array in (record.get("inputs") or {}).values():
            array.flags.writeable = False
        self._held[label] = record
        return _copy(record)

    def _path(self, label: str) -> Path:
        return self.directory / (hashlib.sha256(label.encode("utf-8")).hexdigest() + ".npz")

    def load(self, label: str) -> dict[str, Any] | None:
        if self._held is not None and label in self._held:
            return _copy(self._held[label])
        path = self._path(label)
        try:
            with np.load(path, allow_pickle=False) as data:
                document = json.loads(str(data["record"]))
                if document.get("format") != FORMAT or document.get("label") != label:
                    raise ValueError(f"not a {FORMAT} record of {label[:40]!r}")
                record = {key: _decoded(value) for key, value in document["fields"].items()}
                if document["inputs"] is not None:
                    record["inputs"] = {
                        name: np.array(data[f"a{i}"]) for i, name in enumerate(document["inputs"])
                    }
        except FileNotFoundError:
            return None
        except _UNREADABLE as exc:
            raise ConfigurationError(
                f"{path}: a session record of this node is unreadable ({exc}); delete {self.directory} "
                "(the run's records) and run the session again"
            ) from None
        return self._hold(label, record)

    def save(self, label: str, record: Mapping[str, Any]) -> None:
        inputs = record.get("inputs")
        names = sorted(inputs) if inputs is not None else None
        arrays = {}
        for i, name in enumerate(names or ()):
            array = np.ascontiguousarray(inputs[name])  # type: ignore[index]
            if array.dtype.hasobject:  # np.savez would pickle it, and load refuses a pickle
                raise TypeError(f"the record's input {name!r} is not a numeric array")
            arrays[f"a{i}"] = array
        document = {
            "format": FORMAT,
            "label": label,
            "fields": {key: _encoded(value, key) for key, value in record.items() if key != "inputs"},
            "inputs": names,
        }
        buffer = io.BytesIO()
        np.savez(buffer, record=np.array(json.dumps(document, allow_nan=True)), **arrays)
        self._make_directory()
        write_with_mode(self._path(label), buffer.getvalue(), 0o600)
        if self._held is not None:
            held = {key: value for key, value in record.items() if key != "inputs"}
            if names is not None:
                # copies: the caller's arrays stay its own (writable); cheaper than reading the file
                held["inputs"] = {name: np.array(arrays[f"a{i}"]) for i, name in enumerate(names)}
            self._hold(label, held)


def _copy(record: Mapping[str, Any]) -> dict[str, Any]:
    copied = dict(record)
    if copied.get("inputs") is not None:
        copied["inputs"] = dict(copied["inputs"])
    return copied


def _encoded(value: Any, key: str) -> Any:
    """A field as JSON: what Flower's ConfigRecord holds (text, numbers, yes/no, bytes, lists)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return {"bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, list | tuple):
        return [_encoded(item, key) for item in value]
    raise TypeError(f"the record's field {key!r} holds a {type(value).__name__}, which a record cannot keep")


def _decoded(value: Any) -> Any:
    if isinstance(value, dict):
        return base64.b64decode(value["bytes"], validate=True)
    if isinstance(value, list):
        return [_decoded(item) for item in value]
    return value
