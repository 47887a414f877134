"""What the backend tells: logs and structured traces (``report``), the wire traffic of a program
(``traffic``), each rank's FLOPs (``flops``), and explain's HTML page (``html_report``). They import nothing
else of the backend.
"""
