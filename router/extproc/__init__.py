"""kvroute as an Envoy ext_proc endpoint picker (Gateway API Inference Extension protocol):
Envoy forwards the bytes, kvroute only says where. `ExtProcServer` runs inside `kvroute
serve`; `add_arguments` / `server_from_args` are its command-line flags."""
