"""Using a trained model on the CPU: evaluation (accuracy, loss, per class, confusion) and prediction.

The forward pass is the numpy stage's (`Model.logits`: `reference.logits` for an MLP,
`reference_cnn.logits` on the normalised features for a cnn, float32, the same chunks), so a model
the numpy stage trained evaluates to exactly the test accuracy its run reported. A model trained
on the GPU evaluates to its run's accuracy up to the test samples whose two top logits are so
close that the GPU's and NumPy's float32 rounding order them differently.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from rich.table import Table

from graphtrain import reference
from graphtrain.errors import INSTALL_HINTS, MissingRequirement
from graphtrain.files import write_atomic
from graphtrain.model_io import Model
from graphtrain.reference import Layer


@dataclass(frozen=True, eq=False)
class Evaluation:
    """How a model does on labelled samples."""

    confusion: np.ndarray  # (classes, classes) counts: row = true class, column = predicted class
    loss: float  # mean cross-entropy

    @property
    def samples(self) -> int:
        return int(self.confusion.sum())

    @property
    def accuracy(self) -> float:
        return int(np.trace(self.confusion)) / self.samples

    @property
    def class_samples(self) -> np.ndarray:
        return self.confusion.sum(axis=1)

    @property
    def class_accuracy(self) -> np.ndarray:
        """Recall per true class; NaN for a class with no samples."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.diag(self.confusion) / self.class_samples


def log_probabilities(model: Model | list[Layer], features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(predicted class, log-softmax in float64) of each row of features in [0, 1]; the class is
    the float32 logits' argmax. `model`: a saved model, or an MLP's layers."""
    logits = model.logits(features) if isinstance(model, Model) else reference.logits(model, features)
    return logits.argmax(axis=1), reference.log_softmax(logits.astype(np.float64))


def evaluate(model: Model | list[Layer], features: np.ndarray, labels: np.ndarray, classes: int) -> Evaluation:
    predicted, logp = log_probabilities(model, features)
    loss = float(-logp[np.arange(len(labels)), labels].mean())
    confusion = np.zeros((classes, classes), np.int64)
    np.add.at(confusion, (labels, predicted), 1)
    return Evaluation(confusion, loss)


def predict(model: Model | list[Layer], features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The predicted class of each row and the model's probability for it."""
    predicted, logp = log_probabilities(model, features)
    return predicted, np.exp(logp[np.arange(len(predicted)), predicted])


def predictions_csv(predicted: np.ndarray, probability: np.ndarray) -> str:
    lines = ["index,class,probability"]
    lines += [f"{i},{c},{p:.6f}" for i, (c, p) in enumerate(zip(predicted.tolist(), probability.tolist()))]
    return "\n".join(lines) + "\n"


def write_predictions(path: str | os.PathLike[str], predicted: np.ndarray, probability: np.ndarray) -> None:
    write_atomic(path, predictions_csv(predicted, probability))


# --------------------------------------------------------------------------------------------
# Showing an evaluation
# --------------------------------------------------------------------------------------------


def _percent(value: float) -> str:
    return "—" if np.isnan(value) else f"{100 * value:.2f}%"


def class_table(evaluation: Evaluation) -> Table:
    table = Table(title="accuracy per class")
    for column in ("class", "samples", "correct", "accuracy"):
        table.add_column(column, justify="right")
    correct = np.diag(evaluation.confusion)
    for c, (n, k, acc) in enumerate(zip(evaluation.class_samples, correct, evaluation.class_accuracy)):
        table.add_row(str(c), str(n), str(k), _percent(acc))
    return table


def confusion_table(evaluation: Evaluation) -> Table:
    table = Table(title="confusion matrix (rows: true class, columns: predicted class)")
    classes = len(evaluation.confusion)
    table.add_column("true", justify="right")
    for c in range(classes):
        table.add_column(str(c), justify="right")
    for c, row in enumerate(evaluation.confusion):
        # The diagonal in bold: the correct predictions.
        table.add_row(str(c), *(f"[bold]{n}[/]" if i == c else str(n) if n else "·" for i, n in enumerate(row)))
    return table


def require_matplotlib() -> None:
    """Checked before any work: --plot without matplotlib is the user's to fix (exit 2)."""
    from graphtrain.report import matplotlib_missing

    if matplotlib_missing():
        raise MissingRequirement(f"--plot needs matplotlib, which is not installed: {INSTALL_HINTS['plot']}")


def plot_confusion(evaluation: Evaluation, path: str | os.PathLike[str], title: str) -> None:
    """The confusion matrix as a PNG heatmap, each row normalised to the true class's samples."""
    from graphtrain.report import _pyplot, _save

    plt = _pyplot()
    classes = len(evaluation.confusion)
    with np.errstate(invalid="ignore", divide="ignore"):
        rates = evaluation.confusion / evaluation.class_samples[:, None]
    size = min(12.0, 3.0 + 0.5 * classes)
    fig, ax = plt.subplots(figsize=(size + 1.0, size))
    image = ax.imshow(rates, cmap="Blues", vmin=0.0, vmax=1.0)
    fig.colorbar(image, ax=ax, label="share of the true class")
    if classes <= 30:  # labels and counts stay legible up to about this many classes
        ax.set_xticks(range(classes))
        ax.set_yticks(range(classes))
        for (row, col), count in np.ndenumerate(evaluation.confusion):
            if count:
                ax.text(col, row, str(count), ha="center", va="center", fontsize=7,
                        color="white" if rates[row, col] > 0.5 else "black")
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(f"{title}: accuracy {100 * evaluation.accuracy:.2f}%")
    _save(fig, path)  # lays out, writes atomically, closes the figure
