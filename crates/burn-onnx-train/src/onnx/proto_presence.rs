//! Keep attribute values that equal their type's default on the wire.
//!
//! ONNX's schema is proto2: an attribute such as `axis: 0` is *present* with value 0. The
//! protobuf types we use are generated from a proto3 copy of the schema, whose encoder
//! drops fields holding the default value. onnxruntime and `onnx.checker` read a missing
//! `i` as 0 anyway, but tools that test presence (onnx2torch, `HasField`) do not. Before
//! serialising, every attribute whose value field holds the default gets that field back as
//! an explicit unknown field, which the encoder writes verbatim.

use onnx_ir::{AttributeType, GraphProto, ModelProto};

/// Field numbers of `AttributeProto`'s scalar value fields.
const FIELD_F: u32 = 2;
const FIELD_I: u32 = 3;
const FIELD_S: u32 = 4;

fn restore_graph(graph: &mut GraphProto) {
    for node in &mut graph.node {
        for a in &mut node.attribute {
            let unknown = a.special_fields.mut_unknown_fields();
            if unknown.get(FIELD_F).is_some()
                || unknown.get(FIELD_I).is_some()
                || unknown.get(FIELD_S).is_some()
            {
                continue;
            }
            match a.type_.enum_value() {
                Ok(AttributeType::INT) if a.i == 0 => unknown.add_varint(FIELD_I, 0),
                Ok(AttributeType::FLOAT) if a.f.to_bits() == 0 => unknown.add_fixed32(FIELD_F, 0),
                Ok(AttributeType::STRING) if a.s.is_empty() => {
                    unknown.add_length_delimited(FIELD_S, Vec::new())
                }
                _ => {}
            }
        }
    }
}

/// Make default-valued attribute fields explicit in `model` (see the module docs).
pub fn restore_default_attribute_values(model: &mut ModelProto) {
    if let Some(graph) = model.graph.as_mut() {
        restore_graph(graph);
    }
}
