"""A black-box conformance kit for ext_proc endpoint pickers (GIE proposal 004): plays the
gateway over gRPC against any picker and reports pass/fail per protocol case.

    python -m conformance.extproc --picker HOST:PORT --endpoints HOST:PORT,... [--report F]
"""
