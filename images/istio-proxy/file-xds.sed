# Istio's bootstrap template (tools/packaging/common/envoy_bootstrap.json)
# made to run without istiod: Envoy takes LDS and CDS from files instead of
# ADS over pilot-agent's xDS proxy. Only `dynamic_resources` changes; the
# rest (admin, stats, the 15021/15090 listeners, the SDS and xds-grpc
# clusters, which are Unix sockets to the agent) stays Istio's. The files
# are mounted at /etc/istio/xds (e2e/src/node/istio.rs writes them);
# watched_directory makes a ConfigMap update (an atomic symlink swap of
# the directory's ..data) reload them.
/^  "dynamic_resources": {$/,/^  },$/c\
  "dynamic_resources": {\
    "lds_config": {\
      "path_config_source": {\
        "path": "/etc/istio/xds/lds.json",\
        "watched_directory": {"path": "/etc/istio/xds"}\
      },\
      "resource_api_version": "V3"\
    },\
    "cds_config": {\
      "path_config_source": {\
        "path": "/etc/istio/xds/cds.json",\
        "watched_directory": {"path": "/etc/istio/xds"}\
      },\
      "resource_api_version": "V3"\
    }\
  },
