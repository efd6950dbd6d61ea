//! Protobuf services Remora speaks that are not Envoy's own (filled in by the SDS issue).
