"""Checking a version's pre/post-processing and labels files against the files pushed.

The config schema already checks that the steps are known and fit the
model's tensors (`inferbus_common.modelconfig`); what it cannot see are the
files the steps read. A version whose tokenizer or labels file is missing or
unreadable would load on no worker, so the registry refuses it at upload with
a message that names the file and what is wrong.

The registry does not depend on `tokenizers`: a tokenizer file is checked to
be a `tokenizers` JSON document (an object with a ``model``), the worker loads
it for real.

A Python processing file (``preprocessor.py``, issue 27) is compiled and its
top level read (`ast`), never run here: it must compile and define
``preprocess`` and/or ``postprocess``. Like every pushed file it is listed
with its SHA-256 in the signed manifest, so workers verify it before running
it.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable, Collection
from pathlib import Path

from inferbus_common.errors import InvalidArgument
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.processingconfig import (
    PYTHON_FILE,
    ProcessingConfig,
    SoftmaxStep,
    TokenizeStep,
    TopKStep,
)

PYTHON_FUNCTIONS = ("preprocess", "postprocess")


def _count_labels(path: Path, model: str, rel: str) -> int:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"{model}: labels file {rel!r} is not UTF-8 text: {exc}") from exc
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise InvalidArgument(f"{model}: labels file {rel!r} is empty; write one label per line")
    return len(lines)


def _check_tokenizer(path: Path, model: str, rel: str) -> None:
    try:
        doc = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{model}: tokenizer file {rel!r} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("model"), dict):
        raise InvalidArgument(
            f"{model}: tokenizer file {rel!r} is not a `tokenizers` tokenizer.json "
            "(a JSON object with a 'model'); save it with Tokenizer.save()"
        )


def with_python_file(config: ModelConfig, files: Collection[str]) -> ModelConfig:
    """`config` with ``processing.python`` set when the push sent ``preprocessor.py``
    and the config names no Python file (the file alone turns the feature on).

    Raises:
        InvalidArgument: the config then no longer validates (declarative steps
            and a Python file together).
    """
    proc = config.processing
    if PYTHON_FILE not in files or (proc is not None and proc.python is not None):
        return config
    model = config.name or "model"
    if proc is not None and (proc.pre or proc.post):
        raise InvalidArgument(
            f"{model}: the push sent {PYTHON_FILE} and config.json declares processing steps; "
            "one version uses one or the other (do the steps in the Python file)"
        )
    new = proc.model_copy(update={"python": PYTHON_FILE}) if proc else None
    return config.model_copy(update={"processing": new or ProcessingConfig(python=PYTHON_FILE)})


def python_functions(source: bytes, model: str, rel: str) -> set[str]:
    """Which of ``preprocess`` / ``postprocess`` the file defines at its top level.

    Compiled, never run.

    Raises:
        InvalidArgument: it does not compile, or defines neither.
    """
    try:
        tree = ast.parse(source, filename=rel)
        compile(tree, rel, "exec")
    except (SyntaxError, ValueError) as exc:
        raise InvalidArgument(f"{model}: {rel} does not compile: {exc}") from exc
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in PYTHON_FUNCTIONS:
            found.add(node.name)
        elif isinstance(node, ast.AsyncFunctionDef) and node.name in PYTHON_FUNCTIONS:
            raise InvalidArgument(f"{model}: {rel}: {node.name} must be a plain def, not async")
        elif isinstance(node, ast.Assign | ast.ImportFrom):
            targets = (
                [t.id for t in node.targets if isinstance(t, ast.Name)]
                if isinstance(node, ast.Assign)
                else [a.asname or a.name for a in node.names]
            )
            found.update(t for t in targets if t in PYTHON_FUNCTIONS)
    if not found:
        raise InvalidArgument(
            f"{model}: {rel} defines neither preprocess(inputs) nor postprocess(outputs) "
            "at its top level"
        )
    return found


def _check_python(config: ModelConfig, path: Path, model: str, rel: str) -> None:
    found = python_functions(path.read_bytes(), model, rel)
    pairs = [
        ("preprocess", "engine_inputs", config.inputs, config.engine_inputs()),
        ("postprocess", "engine_outputs", config.outputs, config.engine_outputs()),
    ]
    for func, section, client, engine in pairs:
        if func not in found and client != engine:
            raise InvalidArgument(
                f"{model}: processing.{section} differ from the client tensors but {rel} "
                f"defines no {func}() to convert between them"
            )


def check_processing(
    config: ModelConfig, files: Collection[str], path_of: Callable[[str], Path]
) -> None:
    """Check the files the processing steps of `config` read.

    Args:
        config: the version's parsed config.
        files: paths of the pushed files, relative to the version directory.
        path_of: where a pushed file lies on disk.

    Raises:
        InvalidArgument: a referenced file is missing or unreadable, a labels
            file does not name every class of the engine output it labels, or
            top-k asks for more classes than there are.
    """
    proc = config.processing
    if proc is None:
        return
    model = config.name or "model"
    for rel in proc.files():
        if rel not in files:
            raise InvalidArgument(
                f"{model}: processing reads {rel!r} but the push did not send it "
                f"(sent: {sorted(files)}); put it in the version directory"
            )
    if proc.python is not None:
        _check_python(config, path_of(proc.python), model, proc.python)
    for step in proc.pre:
        if isinstance(step, TokenizeStep):
            _check_tokenizer(path_of(step.tokenizer), model, step.tokenizer)
    # Classes per tensor, following softmax steps back to the engine output.
    classes = {s.name: s.shape[-1] for s in config.engine_outputs() if s.shape and s.shape[-1] > 0}
    for post in proc.post:
        if isinstance(post, SoftmaxStep) and post.input in classes:
            classes[post.output or post.input] = classes[post.input]
        if not isinstance(post, TopKStep):
            continue
        n = classes.get(post.input)
        if n is not None and post.k > n:
            raise InvalidArgument(
                f"{model}: top-k step asks for k={post.k} but '{post.input}' has {n} classes"
            )
        if post.labels:
            count = _count_labels(path_of(post.labels), model, post.labels)
            if n is not None and count != n:
                raise InvalidArgument(
                    f"{model}: labels file {post.labels!r} has {count} labels but "
                    f"'{post.input}' has {n} classes; write one label per class, in order"
                )


def check_label_files(
    config: ModelConfig, files: Collection[str], path_of: Callable[[str], Path]
) -> None:
    """Check the labels files the outputs name (``label_filename``, classification).

    Args:
        config: the version's parsed config.
        files: paths of the pushed files, relative to the version directory.
        path_of: where a pushed file lies on disk.

    Raises:
        InvalidArgument: a labels file was not pushed, is not UTF-8 text or is empty.
    """
    model = config.name or "model"
    for spec in config.outputs:
        rel = spec.label_filename
        if rel is None:
            continue
        if rel not in files:
            raise InvalidArgument(
                f"{model}: output '{spec.name}' names labels file {rel!r} but the push did not "
                f"send it (sent: {sorted(files)}); put it in the version directory"
            )
        _count_labels(path_of(rel), model, rel)
