//! Prints NVRTC's log (ptxas `-v`) for one kernel source: `kernel_report gemv [DEFINE...]`;
//! with `CUBIN_OUT=FILE`, also writes the CUBIN there (for `nvdisasm`).
fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let name = args.first().map(String::as_str).unwrap_or("gemv");
    let k = trellm_cuda::kernels::ALL
        .iter()
        .find(|k| k.name == name)
        .ok_or_else(|| anyhow::anyhow!("no kernel source {name}"))?;
    let c = trellm_cuda::nvrtc::compile(k, &args[1.min(args.len())..], "sm_90a", true)?;
    println!("{}", c.log);
    if let Some(out) = std::env::var_os("CUBIN_OUT") {
        std::fs::write(out, &c.cubin)?;
    }
    Ok(())
}
