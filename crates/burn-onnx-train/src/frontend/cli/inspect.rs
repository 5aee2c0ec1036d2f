//! `onnx-train inspect`: what an ONNX file holds (inputs, outputs, op counts, parameters,
//! initializer ties), and on request its automatic pipeline cut and tensor-parallel split.

use std::path::PathBuf;

use burn::tensor::Device;

use crate::error::OnnxError;
use crate::graph::{Dim, Graph, TensorInfo, dims_text};
use crate::model::{OnnxModel, ParamRole};
use crate::parallel::pipeline::Partition;
use crate::value::Value;
use crate::value::host_tensor::dtype;

/// `onnx-train inspect`'s arguments.
#[derive(clap::Args)]
pub struct InspectArgs {
    /// The ONNX file.
    model: PathBuf,
    /// Also print the automatic cut into N pipeline stages (nodes, parameters,
    /// estimated work, the values crossing each cut).
    #[arg(long, value_name = "N")]
    stages: Option<usize>,
    /// Also print the tensor-parallel split over N ranks (the blocks found, each split
    /// weight's axis and period), planned from a probe on zero inputs (symbolic
    /// dimensions: 2 for the first, 8 for the others).
    #[arg(long, value_name = "N")]
    tp: Option<usize>,
}

/// `onnx-train inspect`: the model's description on standard output.
pub fn run(args: InspectArgs) -> Result<(), OnnxError> {
    let InspectArgs {
        model: path,
        stages,
        tp,
    } = args;
    let graph = Graph::load(&path)?;
    let model = OnnxModel::from_graph(graph, &Device::flex())?;
    let g = model.graph();
    println!(
        "model: {} (opset {}, {} nodes)",
        path.display(),
        g.opset,
        g.model.graph.as_ref().map_or(0, |g| g.node.len())
    );
    print_tensors("inputs", &g.inputs);
    print_tensors("outputs", &g.outputs);
    println!("ops:");
    for (op, n) in g.op_counts() {
        println!("  {op:<24} {n}");
    }
    let infos = model.param_infos();
    let count = |role| {
        infos
            .iter()
            .filter(|p| p.role == role)
            .map(|p| p.shape.iter().product::<usize>())
            .sum::<usize>()
    };
    println!(
        "initializers: {} parameters ({} trainable elements, {} state, {} constant), {} host constants",
        infos.len(),
        count(ParamRole::Trainable),
        count(ParamRole::State),
        count(ParamRole::Constant),
        model.constant_infos().len()
    );
    for p in infos {
        println!(
            "  {:<48} {:<16} {}: {}",
            p.name,
            format!("{:?}", p.shape),
            p.role.name(),
            p.reason
        );
    }
    for c in model.constant_infos() {
        println!(
            "  {:<48} {:<16} constant: {}",
            c.name,
            format!("{:?}", c.shape),
            c.reason
        );
    }
    if !model.graph().ties.is_empty() {
        println!("initializer ties (tie_duplicate_initializers / untie_shared_constants):");
        for t in &model.graph().ties {
            println!("  {t}");
        }
    }
    if let Some(n) = stages {
        print_partition(&model, n)?;
    }
    if let Some(n) = tp {
        print_tensor_parallel(model, n)?;
    }
    Ok(())
}

/// `title:` and a line per tensor: its name, element type and dimensions.
fn print_tensors(title: &str, tensors: &[TensorInfo]) {
    println!("{title}:");
    for t in tensors {
        println!(
            "  {} {} {}",
            t.name,
            dtype::name(t.elem_type),
            dims_text(&t.dims)
        );
    }
}

/// The tensor-parallel split of `model` over `n` ranks: blocks, split weights (the
/// vocabulary split taking the first graph output as the logits a cross-entropy reads),
/// and the parameter elements each rank holds.
fn print_tensor_parallel(model: OnnxModel, n: usize) -> Result<(), OnnxError> {
    let shapes: std::collections::HashMap<String, Vec<usize>> = model
        .param_infos()
        .iter()
        .map(|p| (p.name.clone(), p.shape.clone()))
        .collect();
    let sample = model
        .graph()
        .inputs
        .iter()
        .map(|i| {
            let dims: Vec<usize> = i
                .dims
                .iter()
                .enumerate()
                .map(|(k, d)| match d {
                    Dim::Fixed(f) => *f,
                    Dim::Symbolic(_) => {
                        if k == 0 {
                            2
                        } else {
                            8
                        }
                    }
                })
                .collect();
            let len = dims.iter().product();
            let value = if dtype::is_float(i.elem_type) {
                crate::model::float_input(vec![0.0; len], &dims, &Device::flex())?
            } else if i.elem_type == dtype::BOOL {
                Value::Bool(ndarray::ArrayD::from_elem(ndarray::IxDyn(&dims), false))
            } else {
                crate::model::int_input(vec![0; len], &dims)?
            };
            Ok((i.name.clone(), value))
        })
        .collect::<Result<Vec<_>, OnnxError>>()?;
    let options = crate::parallel::tensor_parallel::SplitOptions {
        allow_replicated: true,
        vocab_parallel: true,
        vocab_head: model.graph().outputs.first().map(|o| o.name.clone()),
        sequence_parallel: false,
    };
    let (part, t) =
        crate::parallel::tensor_parallel::TensorParallel::apply(model, sample, 0, n, &options)?;
    println!(
        "tensor parallel: {n} ranks, {} column-parallel projection(s)",
        t.blocks.len()
    );
    for b in &t.blocks {
        println!("  block from {b}");
    }
    if let Some(v) = &t.vocab {
        println!("  head of {} split along its {} classes", v.output, v.vocab);
    }
    for (name, split) in &t.params {
        println!(
            "  split {name} {:?}: axis {}, period {}{}",
            shapes[name],
            split.axis,
            split.period,
            if split.pad > 0 {
                format!(", padded by {}", split.pad)
            } else {
                String::new()
            }
        );
    }
    let whole: usize = shapes.values().map(|s| s.iter().product::<usize>()).sum();
    let local: usize = part
        .param_infos()
        .iter()
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    println!(
        "  parameter elements per rank: {local} of {whole} ({:.1}%)",
        100.0 * local as f64 / whole.max(1) as f64
    );
    Ok(())
}

/// The automatic pipeline cut of `model` into `n` stages, one line per stage.
fn print_partition(model: &OnnxModel, n: usize) -> Result<(), OnnxError> {
    let part = Partition::auto(model, n)?;
    let (elements, flops) = part
        .stages
        .iter()
        .fold((0, 0.0), |(e, f), s| (e + s.param_elements, f + s.flops));
    println!("pipeline: {n} stages");
    for s in &part.stages {
        println!(
            "  stage {}: nodes {}..{} ({}), {} parameters ({:.1}% of elements), {:.1}% of weighted work, receives {} value(s): {}",
            s.index,
            s.nodes.start,
            s.nodes.end,
            s.nodes.len(),
            s.params.len(),
            100.0 * s.param_elements as f64 / elements.max(1) as f64,
            100.0 * s.flops / flops.max(1.0),
            s.receives.len(),
            s.receives.join(", ")
        );
    }
    for p in &part.shared {
        println!(
            "  shared {} ({} elements) held by stages {:?}",
            p.name, p.elements, p.stages
        );
    }
    Ok(())
}
