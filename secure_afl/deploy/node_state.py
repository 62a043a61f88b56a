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
session ends or fails (deploy/client.py), the check's key and values once the node sent its masked
terms, stored the classifier unverified, or refused a message of the check for what it holds
(deploy/verify.py ``forget_check``, ``ends_check``); what an unfinished step left (a session the
coordinator abandoned, a classifier or relay never sent, a refusal for the node's own trouble) stays
until the node's next run starts, which deletes the run's records.
Nothing here is unpickled: the fields are typed JSON, the arrays ``np.load(allow_pickle=False)``.

A record's arrays (a session's inputs: its Gram, 33 MB at d = 2048) are a file of their own, which the
record names.  Within one :meth:`NodeStateFiles.exclusive` (one message), a save whose arrays are
those the record was read or saved with (the same read-only objects) writes the record alone, so a
message, which saves its record twice, writes the Gram no more.  A record's earlier arrays file is
deleted once the record naming another, or none, is in place.  ``load`` and ``save`` outside
``exclusive()`` take it for themselves: no two processes write one run's records at once.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import re
import secrets
import shutil
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from secure_afl.core.locking import exclusive_lock

from .errors import ConfigurationError
from .tls import write_with_mode

STATE_DIR = "sessions"  # in the node's ledger-dir
FORMAT = "secure-afl-node-state/2"  # 2: the arrays in a file of their own
_RUN = re.compile(r"[0-9]{1,20}")  # Flower's run id, an unsigned 64-bit integer
_ARRAYS = re.compile(r"[0-9a-f]{64}-[0-9a-f]{16}\.npz")  # <record's name>-<token>.npz
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
        self._arrays: dict[str, str] = {}  # while exclusive(): each held record's arrays file
        # Forget other runs' records: a finished or abandoned run keeps nothing here.
        for other in sorted(root.iterdir()) if root.is_dir() else ():
            if other.name != run_id and other.is_dir() and not other.is_symlink():
                shutil.rmtree(other)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Held while one message is answered: a second ClientApp of this node (a re-sent copy, a
        message the coordinator sent at the same time) waits, then reads the records the first wrote,
        instead of writing its own older ones over them.  The OS releases it if the process dies.
        One instance per process: flock locks per open file, so a second instance's lock (or load or
        save, which take it when it is not held) waits for the first's, in the same process too."""
        self._make_directory()
        with exclusive_lock(self.directory / ".lock"):
            # Nobody else writes while it is held: a record read again (handle reads a message's
            # record up to three times) comes from memory, not from a 33 MB file at d = 2048; and a
            # temporary file here is one a process killed while writing left (write_with_mode's).
            for left in self.directory.glob(".*.tmp"):
                left.unlink(missing_ok=True)
            self._held = {}
            try:
                yield
            finally:
                self._held, self._arrays = None, {}

    def _make_directory(self) -> None:
        for directory in (self.ledger_dir, self.directory.parent, self.directory):
            directory.mkdir(exist_ok=True, mode=0o700)  # a ledger-dir is 0700 (FileLedger's)

    def _hold(self, label: str, record: dict[str, Any], arrays_file: str | None) -> dict[str, Any]:
        """A copy of ``record`` to return, ``record`` kept while exclusive() is held; its arrays
        read-only, shared by every copy (a caller that changed one in place would change them all, and
        a save of them would not be written: a caller must not set them writeable)."""
        assert self._held is not None  # load and save run within exclusive()
        for array in (record.get("inputs") or {}).values():
            array.flags.writeable = False
        self._held[label] = record
        self._arrays.pop(label, None)
        if arrays_file is not None:
            self._arrays[label] = arrays_file
        return _copy(record)

    def _name(self, label: str) -> str:
        return hashlib.sha256(label.encode("utf-8")).hexdigest()

    def _path(self, label: str) -> Path:
        return self.directory / (self._name(label) + ".npz")

    def load(self, label: str) -> dict[str, Any] | None:
        if self._held is None:
            with self.exclusive():
                return self.load(label)
        if label in self._held:
            return _copy(self._held[label])
        path = self._path(label)
        try:
            with np.load(path, allow_pickle=False) as data:
                document = json.loads(str(data["record"]))
            if document.get("format") != FORMAT or document.get("label") != label:
                raise ValueError(f"not a {FORMAT} record of {label[:40]!r}")
            record = {key: _decoded(value) for key, value in document["fields"].items()}
            arrays_file = document["arrays"]
            if document["inputs"] is not None:
                own = isinstance(arrays_file, str) and _ARRAYS.fullmatch(arrays_file) is not None
                if not own or not arrays_file.startswith(self._name(label) + "-"):
                    raise ValueError(
                        f"the record names no arrays file of its own ({str(arrays_file)[:80]!r})"
                    )
                with np.load(self.directory / arrays_file, allow_pickle=False) as data:
                    record["inputs"] = {
                        name: np.array(data[f"a{i}"]) for i, name in enumerate(document["inputs"])
                    }
        except FileNotFoundError as exc:
            if Path(str(exc.filename)) == path:
                return None
            raise self._unreadable(path, exc) from None
        except _UNREADABLE as exc:
            raise self._unreadable(path, exc) from None
        return self._hold(label, record, arrays_file if document["inputs"] is not None else None)

    def _unreadable(self, path: Path, exc: BaseException) -> ConfigurationError:
        return ConfigurationError(
            f"{path}: a session record of this node is unreadable ({exc}); delete {self.directory} "
            "(the run's records) and run the session again"
        )

    def save(self, label: str, record: Mapping[str, Any]) -> None:
        if self._held is None:
            with self.exclusive():
                self.save(label, record)
            return
        inputs = record.get("inputs")
        names = sorted(inputs) if inputs is not None else None
        arrays = {}
        for i, name in enumerate(names or ()):
            array = np.ascontiguousarray(inputs[name])  # type: ignore[index]
            if array.dtype.hasobject:  # np.savez would pickle it, and load refuses a pickle
                raise TypeError(f"the record's input {name!r} is not a numeric array")
            arrays[f"a{i}"] = array
        fields = {key: _encoded(value, key) for key, value in record.items() if key != "inputs"}
        arrays_file = self._unchanged_arrays(label, inputs)
        written = None
        if names is not None and arrays_file is None:
            arrays_file = written = f"{self._name(label)}-{secrets.token_hex(8)}.npz"
            buffer = io.BytesIO()
            np.savez(buffer, **arrays)
            write_with_mode(self.directory / arrays_file, buffer.getvalue(), 0o600)
        document = dict(format=FORMAT, label=label, fields=fields, inputs=names, arrays=arrays_file)
        buffer = io.BytesIO()
        np.savez(buffer, record=np.array(json.dumps(document, allow_nan=True)))
        try:
            write_with_mode(self._path(label), buffer.getvalue(), 0o600)
        except BaseException:
            if written is not None:  # no record names it: the arrays just written go again
                (self.directory / written).unlink(missing_ok=True)
            raise
        # The record names its arrays now: any other arrays file of it (the Gram it named before, one a
        # crash left) goes, so a record saved without its arrays leaves none on the disk.
        for other in self.directory.glob(self._name(label) + "-*.npz"):
            if other.name != arrays_file:
                other.unlink(missing_ok=True)
        held = {key: value for key, value in record.items() if key != "inputs"}
        if names is not None:
            # New arrays are copied: the caller's stay its own (writable); cheaper than reading the file.
            held["inputs"] = (
                dict(inputs)  # type: ignore[arg-type]
                if written is None
                else {name: np.array(arrays[f"a{i}"]) for i, name in enumerate(names)}
            )
        self._hold(label, held, arrays_file)

    def _unchanged_arrays(self, label: str, inputs: Mapping[str, Any] | None) -> str | None:
        """The arrays file of the record held for ``label`` when ``inputs`` are its very arrays
        (read-only, so unchanged since they were read or written), else None."""
        held = self._held.get(label, {}).get("inputs") if self._held is not None else None
        if inputs is None or held is None or label not in self._arrays or sorted(inputs) != sorted(held):
            return None
        return self._arrays[label] if all(inputs[name] is held[name] for name in held) else None


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
