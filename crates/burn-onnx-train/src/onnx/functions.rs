//! Model-local functions (`ModelProto.functions`, emitted e.g. by PyTorch's dynamo exporter):
//! every call is replaced by the function's body before the graph is checked, with the
//! function's formal inputs and outputs bound to the call's edges, its internal edges and
//! node names prefixed by the call's name, and attribute references (`ref_attr_name`)
//! resolved against the call's attributes or the function's defaults.

use std::collections::HashMap;

use onnx_ir::{AttributeProto, ModelProto, NodeProto};

use crate::error::{OnnxError, Result};

/// Deepest nesting of function calls accepted (guards against recursive functions).
const MAX_DEPTH: usize = 32;

struct Function<'a> {
    inputs: &'a [String],
    outputs: &'a [String],
    defaults: &'a [AttributeProto],
    body: &'a [NodeProto],
}

type Library<'a> = HashMap<(&'a str, &'a str), Function<'a>>;

fn domain(d: &str) -> &str {
    if d.is_empty() { "ai.onnx" } else { d }
}

/// The main graph's nodes with every local-function call expanded.
pub fn inline_functions(model: &ModelProto, nodes: &[NodeProto]) -> Result<Vec<NodeProto>> {
    let library: Library = model
        .functions
        .iter()
        .map(|f| {
            (
                (domain(&f.domain), f.name.as_str()),
                Function {
                    inputs: &f.input,
                    outputs: &f.output,
                    defaults: &f.attribute_proto,
                    body: &f.node,
                },
            )
        })
        .collect();
    if library.is_empty() {
        return Ok(nodes.to_vec());
    }
    let mut out = Vec::with_capacity(nodes.len());
    for (i, n) in nodes.iter().enumerate() {
        expand(&library, n, &format!("{}#{i}", n.op_type), 0, &mut out)?;
    }
    Ok(out)
}

fn expand(
    library: &Library,
    call: &NodeProto,
    fallback_name: &str,
    depth: usize,
    out: &mut Vec<NodeProto>,
) -> Result<()> {
    let Some(f) = library.get(&(domain(&call.domain), call.op_type.as_str())) else {
        out.push(call.clone());
        return Ok(());
    };
    let name = if call.name.is_empty() {
        fallback_name
    } else {
        call.name.as_str()
    };
    if depth >= MAX_DEPTH {
        return Err(OnnxError::Node {
            node: name.into(),
            op_type: call.op_type.clone(),
            message: format!("local functions nest deeper than {MAX_DEPTH} (recursive?)"),
        });
    }
    let mut binding: HashMap<&str, String> = HashMap::new();
    for (k, formal) in f.inputs.iter().enumerate() {
        binding.insert(formal, call.input.get(k).cloned().unwrap_or_default());
    }
    for (k, formal) in f.outputs.iter().enumerate() {
        binding.insert(formal, call.output.get(k).cloned().unwrap_or_default());
    }
    let rename = |edge: &String| -> String {
        if edge.is_empty() {
            return String::new();
        }
        binding
            .get(edge.as_str())
            .cloned()
            .unwrap_or_else(|| format!("{name}/{edge}"))
    };
    for (k, inner) in f.body.iter().enumerate() {
        let mut node = inner.clone();
        node.input = inner.input.iter().map(rename).collect();
        node.output = inner.output.iter().map(rename).collect();
        node.name = format!(
            "{name}/{}",
            if inner.name.is_empty() {
                format!("{}#{k}", inner.op_type)
            } else {
                inner.name.clone()
            }
        );
        node.attribute = inner
            .attribute
            .iter()
            .filter_map(|a| {
                if a.ref_attr_name.is_empty() {
                    return Some(a.clone());
                }
                let source = call
                    .attribute
                    .iter()
                    .chain(f.defaults)
                    .find(|c| c.name == a.ref_attr_name)?;
                let mut resolved = source.clone();
                resolved.name = a.name.clone();
                Some(resolved)
            })
            .collect();
        let inner_name = node.name.clone();
        expand(library, &node, &inner_name, depth + 1, out)?;
    }
    Ok(())
}
