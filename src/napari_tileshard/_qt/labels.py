"""A word-wrapped label whose size hints follow its width.

A QLabel with word wrap reports its height for some width of its own choosing; a dock (a
QMainWindow dock area does not lay out height-for-width) then gives two lines of a three-line
message the room of one, and the dock's other widgets are drawn over each other when space is
short.  This label answers for the width it has, and asks for a new layout when that width changes
the height it needs.
"""

from __future__ import annotations

from qtpy.QtCore import QSize
from qtpy.QtWidgets import QLabel

__all__ = ["WrappedLabel"]


class WrappedLabel(QLabel):
    def __init__(self, text: str = "", parent=None):
        super().__init__(text, parent)
        self.setWordWrap(True)

    def _height(self, hint: QSize) -> int:
        width = self.width() if self.width() > 1 else hint.width()
        return self.heightForWidth(width) if self.text() else 0

    def sizeHint(self) -> QSize:
        hint = super().sizeHint()
        return QSize(hint.width(), self._height(hint))

    def minimumSizeHint(self) -> QSize:
        hint = super().minimumSizeHint()
        return QSize(hint.width(), self._height(self.sizeHint()))

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        if self.text() and self.heightForWidth(self.width()) != self.height():
            self.updateGeometry()  # a new width, another number of lines: lay out again
