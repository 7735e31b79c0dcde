# A launched process follows its launcher before it imports or starts anything (rlvla3/lifetime.py).
from rlvla3.lifetime import follow_launcher

follow_launcher()

from rlvla3.app.cli import main  # noqa: E402

main()
