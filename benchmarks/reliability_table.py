"""Print the table of `make reliability`: faults injected per kind, survived, data lost (must be 0)."""

import json
import sys
from pathlib import Path

report = json.loads(Path(sys.argv[1]).read_text()) if Path(sys.argv[1]).is_file() else {}
print(f"| {'fault':<28} | injected | survived | data lost |")
print(f"|{'-' * 30}|----------|----------|-----------|")
for kind, row in sorted(report.items()):
    print(f"| {kind:<28} | {row['injected']:>8} | {row['survived']:>8} | {row['data_lost']:>9} |")
total_lost = sum(row["data_lost"] for row in report.values())
sys.exit(1 if total_lost or not report else 0)
